"""The front door: the router (`Generate` = prefill on one instance, then decode on
another, placed by cached prefix) and the OpenAI-compatible HTTP front end over it or over
vLLM servers (docs/http.md). It talks to instances over gRPC only."""
