"""A prefill instance, a decode instance and a router as `pdxfer serve` processes on this
machine: what `launch` and `bench serve` run their requests against."""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from transfer.serving.engine.serve_options import ANY_PORT, serve_default, serve_flags
from transfer.serving.launch.procs import (
    LAUNCH_ID_ENV,
    ServeProcess,
    check_health,
    start_serve,
    stop_all,
    wait_ready,
)
from transfer.serving.role import INSTANCE_ROLES, ServeRole


@dataclass(frozen=True)
class LocalPairConfig:
    """What `LocalPair` starts; each setting named as serve's has serve's default and flag."""

    model: str
    prefill_tp: int = serve_default("tp")
    decode_tp: int = serve_default("tp")
    ssm_dtype: str = serve_default("ssm_dtype")
    transport: str = serve_default("transport")
    gpu_mem: str = serve_default("gpu_mem")
    device: str = serve_default("device")
    max_seqs: int = serve_default("max_seqs")
    block_size: int = serve_default("block_size")
    seed: int = serve_default("seed")
    dump_dir: Path | None = None
    timeout_s: float = 300.0
    lease_s: float = serve_default("lease_seconds")
    metrics: bool = False  # serve /metrics on each worker (on a port it picks and announces)
    max_num_batched_tokens: int = serve_default("max_num_batched_tokens")
    staging_mib: int = serve_default("staging_mib")
    staging_min_packed: int = serve_default("staging_min_packed")
    prefix_cache: bool = serve_default("prefix_cache")  # both instances'
    checkpoint_interval: int = serve_default("checkpoint_interval")  # the prefill instance's
    transfer_mode: str = serve_default("transfer_mode")  # both instances' (--transfer-mode)
    stream_layers: int = serve_default("stream_layers")  # both instances' (--stream-layers)


class LocalPair:
    """Started by `start`, stopped (every process, Ctrl-C included) by `close`.

    Every child carries the run's id in its environment (LAUNCH_ID_ENV), so tests can find
    leftovers, and a fresh control-plane token (`token`)."""

    def __init__(
        self, config: LocalPairConfig, run_dir: Path, env: Mapping[str, str] | None = None
    ) -> None:
        """`env`: more environment for every child (a trace directory, say)."""
        self.config = config
        self.run_dir = run_dir
        self.token = uuid.uuid4().hex
        self.env = {
            **(env or {}),
            LAUNCH_ID_ENV: os.environ.get(LAUNCH_ID_ENV) or uuid.uuid4().hex,
            "PDXFER_AUTH_TOKEN": self.token,
        }
        self.procs: list[ServeProcess] = []

    def _worker_args(self, role: str, tp: int, port: int = 0) -> list[str]:
        c = self.config
        return serve_flags(
            {
                "host": "127.0.0.1", "port": port, "model": c.model,
                "metrics_port": ANY_PORT if c.metrics else 0, "ssm_dtype": c.ssm_dtype,
                "transport": c.transport, "gpu_mem": c.gpu_mem, "device": c.device,
                "max_seqs": c.max_seqs, "max_num_batched_tokens": c.max_num_batched_tokens,
                "staging_mib": c.staging_mib, "staging_min_packed": c.staging_min_packed,
                "block_size": c.block_size, "seed": c.seed,
                "dump_dir": c.dump_dir, "tp": tp, "instance_id": f"{role}-0",
                "lease_seconds": c.lease_s, "prefix_cache": c.prefix_cache,
                "checkpoint_interval": c.checkpoint_interval, "transfer_mode": c.transfer_mode,
                "stream_layers": c.stream_layers,
            }
        )  # fmt: skip

    def start_workers(self) -> None:
        """Start both instances (they load in parallel); `start_router` waits for them."""
        for role, tp in zip(
            INSTANCE_ROLES, (self.config.prefill_tp, self.config.decode_tp), strict=True
        ):
            self.procs.append(
                start_serve(role, self._worker_args(role, tp), self.run_dir, self.env)
            )

    def start_router(self) -> str:
        """Wait for the workers, start the router, check every health; its address."""
        workers = self.procs[:2]
        wait_ready(workers, self.config.timeout_s)
        router_args = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
                       "--prefill", workers[0].address, "--decode", workers[1].address]  # fmt: skip
        self.procs.append(start_serve(ServeRole.ROUTER, router_args, self.run_dir, self.env))
        wait_ready(self.procs[-1:], self.config.timeout_s)
        check_health(self.procs, self.config.timeout_s)
        return self.procs[-1].address

    def restart_worker(self, index: int) -> None:
        """Stop worker `index` (0 prefill, 1 decode) if it still runs, and start it again on
        the same port, as a supervisor would; returns once it is READY."""
        old = self.procs[index]
        stop_all([old], grace_s=2.0)
        role, tp = INSTANCE_ROLES[index], (self.config.prefill_tp, self.config.decode_tp)[index]
        port = int(old.address.rpartition(":")[2])
        new = start_serve(role, self._worker_args(role, tp, port), self.run_dir, self.env)
        self.procs[index] = new
        wait_ready([new], self.config.timeout_s)

    @property
    def router_address(self) -> str:
        return self.procs[2].address

    def close(self) -> None:
        stop_all(self.procs)
        self.procs.clear()
