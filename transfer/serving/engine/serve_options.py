"""What `pdxfer serve` was asked to run: one typed value, built by the CLI from its flags.

Field names are the flags' (`--max-num-seqs` is `max_seqs`); `serve` and its helpers read
nothing else, so library code never sees argparse. This class is the one place a serve
setting's default is written: argparse (serve, up, launch, bench serve), `LaunchConfig`,
`LocalPairConfig` and `InstanceConfig` read theirs through `serve_default`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import Enum, StrEnum
from typing import Any, TypeVar

from transfer.errors import InvalidInput
from transfer.serving.engine.checkpoints import DEFAULT_STATE_CHECKPOINTS
from transfer.serving.ranks.progress import DEFAULT_STREAM_LAYERS, TransferMode
from transfer.serving.role import ServeRole

# `--metrics-port any`: the process binds a port the OS picks and announces it on its
# READY line, so a launcher never races another process for a port it chose free.
ANY_PORT = -1

E = TypeVar("E", bound=Enum)


class RouterBackend(StrEnum):
    """What the router fronts: pdxfer's own prefill/decode workers (gRPC), or vLLM OpenAI
    servers with a KV connector (HTTP, vLLM's two-step P/D protocol)."""

    PDXFER = "pdxfer"
    VLLM = "vllm"


@dataclass(frozen=True)
class ServeOptions:
    role: ServeRole
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 9400  # 0: off; ANY_PORT: one the OS picks
    auth_token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    insecure: bool = False
    tls_ca: str | None = None
    model: str = "tiny-qwen3-next"
    ssm_dtype: str = "auto"
    tp: int = 1
    transport: str = "nixl"
    data_host: str | None = None
    device: str = "cpu"
    gpu_mem: str = "256MiB"
    max_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_queue: int = 32
    staging_mib: int = 8
    staging_min_ranges: int = 8
    # Stage only a transfer that packs this many ranges: below it, the Stage round trip
    # (and its wait for the prefill loop) costs more than the READs it saves.
    staging_min_packed: int = 256
    prefix_cache: bool = True
    state_checkpoints: int = DEFAULT_STATE_CHECKPOINTS
    checkpoint_interval: int = 0
    transfer_mode: TransferMode = TransferMode.WHOLE
    stream_layers: int = DEFAULT_STREAM_LAYERS
    block_size: int = 16
    lease_seconds: float = 30.0
    seed: int = 0
    instance_id: str | None = None
    dump_dir: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    dist_addr: str | None = None
    engine: RouterBackend = RouterBackend.PDXFER
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    prefill_peers: tuple[str, ...] = ()
    http_port: int | None = None
    api_key_file: str | None = None
    served_model_name: str | None = None
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", as_enum(ServeRole, self.role, "role"))
        object.__setattr__(self, "engine", as_enum(RouterBackend, self.engine, "engine"))
        object.__setattr__(
            self, "transfer_mode", as_enum(TransferMode, self.transfer_mode, "transfer_mode")
        )

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> ServeOptions:
        """The options among `values` (e.g. the parsed flags); other keys are ignored."""
        known = {f.name for f in fields(cls)}
        picked = {k: v for k, v in values.items() if k in known}
        for name in ("prefill", "decode", "prefill_peers"):
            if name in picked:
                picked[name] = tuple(picked[name] or ())
        return cls(**picked)


def as_enum(kind: type[E], value: object, field: str) -> E:
    """`value` (a member or its value) as a member of `kind`; InvalidInput naming `field`."""
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(member.value for member in kind)
        raise InvalidInput(f"{field}: must be one of {choices}, got {value!r}") from None


_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(ServeOptions)}


def serve_default(name: str) -> Any:
    """The default of serve's flag for the `ServeOptions` field `name` (KeyError if none)."""
    return _DEFAULTS[name]


def serve_flags(values: Mapping[str, Any]) -> list[str]:
    """`pdxfer serve` arguments that set the `ServeOptions` fields in `values` (the inverse
    of `from_values`): `--name value`, a tuple's items repeated, a bool as `--name` or, where
    its default is on, `--no-name`; None is left to the default."""
    flags: list[str] = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if name not in _DEFAULTS:
            raise KeyError(f"{name}: not a serve option")
        if value is None:
            continue
        if isinstance(value, bool):
            if value:
                flags.append(flag)
            elif _DEFAULTS[name]:
                flags.append("--no-" + flag[2:])
        elif isinstance(value, tuple | list):
            flags += [part for item in value for part in (flag, str(item))]
        elif name == "metrics_port" and value == ANY_PORT:
            flags += [flag, "any"]
        else:
            flags += [flag, str(value)]
    return flags
