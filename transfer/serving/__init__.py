"""pdxfer's own serving engine: prefill and decode instances, the router and its HTTP front
end, and the launchers that run them as processes (docs/workers.md).

Layers, from the ground up: root < ranks < engine < openai < services < launch

- root (this folder's modules): roles, HOST:PORT addresses, and what every child process
  does about its parent (`child_process`).
- ranks/: the TP rank processes and what runs in them: the control-to-rank protocol and
  commands, the rank worker (model shard, arena, transfers), layer-wise streaming's
  progress words, and the spec a control process hands its ranks.
- engine/: what schedules requests in one instance (its control process): the instance,
  the prefill and decode engines (one loop each) and their workers, the cache manager,
  checkpoints, read planning, the decode side of a stream, and `ServeOptions`.
- openai/: the front door: the router, prefix routing, and the OpenAI-compatible HTTP
  front end over the router or over vLLM servers. From engine/ it takes `ServeOptions` only.
- services/: `pdxfer serve`: the process that puts an engine, a router or the vLLM front
  behind gRPC and HTTP, with its security checks.
- launch/: starting, watching and stopping serve and vLLM processes (`launch`, `up`,
  `bench serve`), and the check behind `launch --verify`.

A module imports only from its own layer and those before it (tests/unit/test_layering.py
reads the order from the line above).
"""
