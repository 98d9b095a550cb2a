"""Start real vLLM OpenAI servers (prefill, decode or colocated) as child processes, wait for
their `/health`, and stop them with every process they started.

vLLM runs in its own interpreter (`--vllm-python`, usually a second venv: its pins differ from
pdxfer's main venv), so nothing here imports vllm. Each server runs in its own session: its
process group holds vLLM's engine-core and TP worker processes too, so stopping the group
leaves nothing behind; on Linux the server also gets SIGTERM if the launcher dies.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transfer.geometry import LayerKind
from transfer.hf_geometry import from_hf_config
from transfer.net import free_port
from transfer.serving.child_process import die_with_parent
from transfer.serving.launch.procs import group_alive, signal_group

VLLM_ENTRYPOINT = "vllm.entrypoints.openai.api_server"
# On CPU vLLM's --gpu-memory-utilization is a share of RAM; a fixed byte budget keeps each
# server small and the same on every machine.
DEFAULT_KV_CACHE_BYTES = 128 << 20
DEFAULT_MAX_MODEL_LEN = 2048


class Connector(enum.Enum):
    """Which KV connector moves the cache between a vLLM prefill and decode server."""

    PDXFER = "pdxfer"
    NIXL = "nixl"


def connector_config(connector: Connector) -> dict[str, Any]:
    """The `--kv-transfer-config` document for `connector` (both servers use the same one)."""
    if connector is Connector.PDXFER:
        return {
            "kv_connector": "PdxferConnector",
            "kv_connector_module_path": "transfer.vllm",
            "kv_role": "kv_both",
            # vLLM's default, "fail", answers a request whose load failed (prefill died, verify
            # found a difference) with an error; pdxfer's serving stack computes it instead.
            "kv_load_failure_policy": "recompute",
        }
    # vLLM's CPU build keeps the KV cache in host memory: NIXL must read it there.
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


def connector_env(connector: Connector) -> dict[str, str]:
    """Environment one server needs for `connector` (call once per server: NIXL's side-channel
    port must differ between servers on one host)."""
    if connector is Connector.PDXFER:
        return {}
    return {
        # NixlConnector reads hybrid conv state only in this layout (vLLM's default is DT).
        "VLLM_SSM_CONV_STATE_LAYOUT": "DS",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
    }


def omp_binds(tps: list[int], cpus: list[int] | None = None) -> list[str]:
    """`VLLM_CPU_OMP_THREADS_BIND` for servers of TP sizes `tps` on one host: every rank of
    every server gets its own share of the allowed CPUs. With more ranks than CPUs, servers
    still get disjoint CPUs while there are enough (a TP-2 server's ranks then share its
    CPUs), and ranks of different servers share CPUs only beyond that. vLLM's default binds
    every server to all CPUs, and its OpenMP threads then fight: two servers on two cores
    decoded at 0.1-0.4 tokens/s that way. A server's idle ranks spin (vLLM's shm-broadcast
    readers yield in a loop for 1 s after each read), so a rank pinned beside another
    server's rank starves it (a decode rank's NIXL connect hung pinned so at TP 1 -> 2)."""
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if sum(tps) <= len(cpus):
        share = len(cpus) // sum(tps)
        per_rank = [cpus[rank * share : (rank + 1) * share] for rank in range(sum(tps))]
        groups, first = [], 0
        for tp in tps:
            groups.append(per_rank[first : first + tp])
            first += tp
    elif len(tps) <= len(cpus):
        share = len(cpus) // len(tps)
        server_cpus = [cpus[s * share : (s + 1) * share] for s in range(len(tps))]
        groups = [
            [[own[rank % len(own)]] for rank in range(tp)]
            for tp, own in zip(tps, server_cpus, strict=True)
        ]
    else:
        groups, rank = [], 0
        for tp in tps:
            groups.append([[cpus[(rank + r) % len(cpus)]] for r in range(tp)])
            rank += tp
    return ["|".join(",".join(str(cpu) for cpu in ranks) for ranks in server) for server in groups]


@dataclass(frozen=True)
class VllmServerSpec:
    """One vLLM OpenAI server: `model` a checkpoint directory, served at host:port."""

    model: Path
    port: int
    name: str = "vllm"
    host: str = "127.0.0.1"
    tp: int = 1
    kv_transfer_config: Mapping[str, Any] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    python: str = sys.executable
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    extra_args: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def model_args(model: Path) -> tuple[str, ...]:
    """Flags vLLM's CPU build needs to serve the checkpoint `model` (read from its
    config.json). Mamba2 (Nemotron-H): with prefix caching on (vLLM's default, which puts
    the mamba cache in "align" mode) vllm-cpu 0.32's first prompt longer than one SSD chunk
    kills the engine ("IndexError: index 9 is out of bounds for dimension 0 with size 1" in
    `mamba_mixer2.conv_ssm_forward`, a 600-token prompt)."""
    if not (model / "config.json").is_file():
        return ()
    kinds = {layer.spec.kind for layer in from_hf_config(model).layers}
    if LayerKind.MAMBA2 in kinds:
        return ("--no-enable-prefix-caching",)
    return ()


def vllm_command(spec: VllmServerSpec) -> list[str]:
    """The server's argv (the `vllm` console script is not used: it fails in vllm-cpu)."""
    cmd = [
        spec.python, "-m", VLLM_ENTRYPOINT,
        "--model", str(spec.model),
        "--host", spec.host,
        "--port", str(spec.port),
        "--tensor-parallel-size", str(spec.tp),
        # CPU GDN runs in bf16 only; CUDA graphs do not exist on CPU.
        "--dtype", "bfloat16",
        "--enforce-eager",
        "--max-model-len", str(spec.max_model_len),
        "--kv-cache-memory-bytes", str(spec.kv_cache_bytes),
        "--served-model-name", spec.model.name, str(spec.model),
    ]  # fmt: skip
    if spec.kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(dict(spec.kv_transfer_config))]
    return cmd + list(model_args(spec.model)) + list(spec.extra_args)


def vllm_environment(spec: VllmServerSpec) -> dict[str, str]:
    env = {**os.environ, **spec.env}
    if spec.tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in spec.env:
        # vLLM's "auto" puts one rank per NUMA node: TP 2 on one node would not start.
        (env["VLLM_CPU_OMP_THREADS_BIND"],) = omp_binds([spec.tp])
    return env


class VllmServer:
    """A started vLLM server; its stdout and stderr go to `log_path`."""

    def __init__(self, spec: VllmServerSpec, popen: subprocess.Popen, log_path: Path, log):
        self.spec = spec
        self.popen = popen
        self.log_path = log_path
        self._log = log

    @property
    def url(self) -> str:
        return self.spec.url

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2.0) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, timeout_s: float) -> None:
        """Poll `/health` until it answers 200; RuntimeError (with the log's tail) if the
        server exits first or `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            code = self.popen.poll()
            if code is not None:
                raise RuntimeError(
                    f"vLLM server {self.spec.name} exited with code {code} before it was "
                    f"healthy (log {self.log_path}):\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vLLM server {self.spec.name} not healthy within {timeout_s:g}s "
                    f"(log {self.log_path}):\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the server's process group, then SIGKILL whatever is left after `grace_s`."""
        signal_group(self.popen.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=grace_s)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and group_alive(self.popen.pid):
            time.sleep(0.1)
        signal_group(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5.0)
        self._log.close()


def start_vllm_server(spec: VllmServerSpec, log_dir: Path) -> VllmServer:
    """Start `spec` (returns at once; call `wait_healthy`)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{spec.name}.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed in VllmServer.stop
    popen = subprocess.Popen(
        vllm_command(spec),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=vllm_environment(spec),
        start_new_session=True,
        preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
    )
    return VllmServer(spec, popen, log_path, log)
