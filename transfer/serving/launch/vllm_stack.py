"""A vLLM prefill server and a vLLM decode server with one KV connector, started together on
this machine (each on its own share of the CPUs) and stopped together: what `pdxfer up
--engine vllm`, `pdxfer bench vllm` and the tests run."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from transfer.net import free_port
from transfer.serving.launch.vllm_servers import (
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_MAX_MODEL_LEN,
    Connector,
    VllmServer,
    VllmServerSpec,
    connector_config,
    connector_env,
    omp_binds,
    start_vllm_server,
)


@dataclass(frozen=True)
class VllmPdPlan:
    """What to start: `model` a checkpoint directory, served by `python`'s vLLM."""

    model: Path
    connector: Connector
    python: str
    prefill_tp: int = 1
    decode_tp: int = 1
    host: str = "127.0.0.1"
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES


def pd_specs(plan: VllmPdPlan) -> tuple[VllmServerSpec, VllmServerSpec]:
    """The prefill and decode servers' specs, on free ports of `plan.host`."""
    binds = omp_binds([plan.prefill_tp, plan.decode_tp])
    specs = []
    for name, tp, bind in (("prefill", plan.prefill_tp, binds[0]),
                           ("decode", plan.decode_tp, binds[1])):  # fmt: skip
        env = {**connector_env(plan.connector), "VLLM_CPU_OMP_THREADS_BIND": bind}
        specs.append(
            VllmServerSpec(
                model=plan.model,
                port=free_port(plan.host),
                name=name,
                host=plan.host,
                tp=tp,
                kv_transfer_config=connector_config(plan.connector),
                env=env,
                python=plan.python,
                max_model_len=plan.max_model_len,
                kv_cache_bytes=plan.kv_cache_bytes,
            )
        )
    return specs[0], specs[1]


@contextlib.contextmanager
def running_vllm_pd(
    plan: VllmPdPlan, log_dir: Path, timeout_s: float
) -> Iterator[tuple[VllmServer, VllmServer]]:
    """Start both servers, wait until both answer /health (RuntimeError with the log's tail
    otherwise), yield (prefill, decode); stop both, with all their processes, on exit."""
    servers: list[VllmServer] = []
    try:
        for spec in pd_specs(plan):
            servers.append(start_vllm_server(spec, log_dir))
        for server in servers:
            server.wait_healthy(timeout_s)
        yield servers[0], servers[1]
    finally:
        for server in servers:
            server.stop()
