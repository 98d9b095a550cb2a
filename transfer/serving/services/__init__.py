"""`pdxfer serve prefill|decode|router`: the process entry that puts an engine, a router or
the vLLM front behind gRPC and HTTP, with its security checks and network interfaces."""
