"""A prefill instance, a decode instance and a router as `pdxfer serve` processes on this
machine: what `launch` and `bench serve` run their requests against."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from transfer.serving.procs import (
    LAUNCH_ID_ENV,
    ServeProcess,
    check_health,
    start_serve,
    stop_all,
    wait_ready,
)
from transfer.serving.progress import DEFAULT_STREAM_LAYERS


@dataclass(frozen=True)
class LocalPairConfig:
    model: str
    prefill_tp: int = 1
    decode_tp: int = 1
    ssm_dtype: str = "auto"
    transport: str = "nixl"
    gpu_mem: str = "64MiB"
    device: str = "cpu"
    max_seqs: int = 16
    block_size: int = 16
    seed: int = 0
    dump_dir: Path | None = None
    timeout_s: float = 300.0
    lease_s: float = 30.0
    metrics: bool = False  # serve /metrics on each worker (on a port it picks and announces)
    max_num_batched_tokens: int = 2048
    staging_mib: int = 8
    prefix_cache: bool = True  # both instances' prefix caches (--[no-]prefix-cache)
    checkpoint_interval: int = 0  # the prefill instance's (--checkpoint-interval)
    transfer_mode: str = "whole"  # both instances' (--transfer-mode)
    stream_layers: int = DEFAULT_STREAM_LAYERS  # both instances' (--stream-layers)


class LocalPair:
    """Started by `start`, stopped (every process, Ctrl-C included) by `close`.

    Every child carries the run's id in its environment (LAUNCH_ID_ENV), so tests can find
    leftovers, and a fresh control-plane token (`token`)."""

    def __init__(self, config: LocalPairConfig, run_dir: Path) -> None:
        self.config = config
        self.run_dir = run_dir
        self.token = uuid.uuid4().hex
        self.env = {
            LAUNCH_ID_ENV: os.environ.get(LAUNCH_ID_ENV) or uuid.uuid4().hex,
            "PDXFER_AUTH_TOKEN": self.token,
        }
        self.procs: list[ServeProcess] = []

    def _worker_args(self, role: str, tp: int, port: int = 0) -> list[str]:
        c = self.config
        return [
            "--host", "127.0.0.1", "--port", str(port), "--model", c.model,
            "--metrics-port", "any" if c.metrics else "0",
            "--ssm-dtype", c.ssm_dtype, "--transport", c.transport, "--gpu-mem", c.gpu_mem,
            "--device", c.device, "--max-seqs", str(c.max_seqs),
            "--max-num-batched-tokens", str(c.max_num_batched_tokens),
            "--staging-mib", str(c.staging_mib),
            "--block-size", str(c.block_size), "--seed", str(c.seed),
            *(["--dump-dir", str(c.dump_dir)] if c.dump_dir else []),
            "--tp", str(tp), "--instance-id", f"{role}-0", "--lease-seconds", str(c.lease_s),
            "--prefix-cache" if c.prefix_cache else "--no-prefix-cache",
            "--checkpoint-interval", str(c.checkpoint_interval),
            "--transfer-mode", c.transfer_mode, "--stream-layers", str(c.stream_layers),
        ]  # fmt: skip

    def start_workers(self) -> None:
        """Start both instances (they load in parallel); `start_router` waits for them."""
        for role, tp in (("prefill", self.config.prefill_tp), ("decode", self.config.decode_tp)):
            self.procs.append(
                start_serve(role, self._worker_args(role, tp), self.run_dir, self.env)
            )

    def start_router(self) -> str:
        """Wait for the workers, start the router, check every health; its address."""
        workers = self.procs[:2]
        wait_ready(workers, self.config.timeout_s)
        router_args = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
                       "--prefill", workers[0].address, "--decode", workers[1].address]  # fmt: skip
        self.procs.append(start_serve("router", router_args, self.run_dir, self.env))
        wait_ready(self.procs[-1:], self.config.timeout_s)
        check_health(self.procs, self.config.timeout_s)
        return self.procs[-1].address

    def restart_worker(self, index: int) -> None:
        """Stop worker `index` (0 prefill, 1 decode) if it still runs, and start it again on
        the same port, as a supervisor would; returns once it is READY."""
        old = self.procs[index]
        stop_all([old], grace_s=2.0)
        role, tp = (("prefill", self.config.prefill_tp), ("decode", self.config.decode_tp))[index]
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
