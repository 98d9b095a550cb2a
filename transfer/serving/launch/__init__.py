"""Start, watch and stop `pdxfer serve` and vLLM processes on one machine (`launch`, `up`,
`bench serve`, `bench vllm`), and the check behind `launch --verify`."""
