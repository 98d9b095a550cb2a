"""The connector's settings (`kv_connector_extra_config`) and the compatibility fields both sides
of a handshake compare.

Every setting and its default is written once, in `PdxferConfig`. The bare
`{"kv_connector": "PdxferConnector", ...}` config works on one machine: the control server binds
loopback on a free port and advertises the port it got.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transfer.control.types import make_compat
from transfer.errors import InvalidInput

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

FIELD_PREFIX = "kv_connector_extra_config"
LAYOUT_VERSION = "vllm-1"
# vLLM reads these at start-up and they change where bytes sit in its tensors.
LAYOUT_ENV_VARS = ("VLLM_SSM_CONV_STATE_LAYOUT", "VLLM_KV_CACHE_LAYOUT")


class TransportKind(str, enum.Enum):
    """The data plane moving the bytes; the value is `make_transport`'s backend name."""

    NIXL = "nixl"
    UCX = "ucx"


@dataclass(frozen=True)
class PdxferConfig:
    """The connector's settings, parsed from `kv_connector_extra_config`.

    auth_token: the control plane's bearer token, read from `auth_token_file` (None: no auth).
    control_host / control_port: where the prefill side's TransferService listens; port 0 picks
        a free one, and the port actually bound is the one tickets advertise.
    lease_s: how long prefill keeps a finished request's cache for decode before freeing it.
        Two minutes by default: a vLLM decode server can take over a minute to reach a request
        (the first request after start-up at TP 2 on CPU took 74 s), and an abandoned request is
        released at once anyway, so only a dead decode holds blocks this long.
    control_timeout_s: the deadline of each control call decode makes to a prefill instance
        (Acquire, Heartbeat, Release and Handshake, all from the scheduler half). A frozen or
        partitioned prefill costs a decode request this long before vLLM computes the prompt itself (a dead one
        refuses the connection at once). Ten seconds by default; raise it when prefill's
        control plane answers slowly under load (an Acquire then fails and decode recomputes).
    test_hold_loads_file: for tests only (fault injection), unset by default. While this file
        exists, a decode worker holds each load it is about to read -- after decode's Acquire
        succeeded, before any read is posted -- and creates `<file>.held` to say so; deleting
        the file lets the load go on. A test can so kill prefill between Acquire and the read.
    verify: prefill digests each published request's cache (per head unit, `digests`) and
        decode checks bit-exactly what landed against them; a mismatch fails the load (vLLM
        recomputes the prompt) and counts `vllm:pdxfer_num_verify_failures`. Off by default:
        it costs a hash over the request's bytes on both sides. Set it on both servers (a
        decode with verify on reads from a prefill without it unchecked, and says so).
    """

    transport: TransportKind = TransportKind.NIXL
    auth_token: str | None = None
    control_host: str = "127.0.0.1"
    control_port: int = 0
    lease_s: float = 120.0
    control_timeout_s: float = 10.0
    verify: bool = False
    test_hold_loads_file: str | None = None

    @property
    def heartbeat_s(self) -> float:
        """How often decode renews a lease it holds: three beats per lease."""
        return self.lease_s / 3

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> PdxferConfig:
        """Parse vLLM's `kv_connector_extra_config`; InvalidInput names the bad field."""
        extra = {} if extra is None else extra
        if not isinstance(extra, Mapping):
            raise InvalidInput(f"{FIELD_PREFIX}: not an object, got {type(extra).__name__}")
        known = {f.name for f in dataclasses.fields(cls)} - {"auth_token"} | {"auth_token_file"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise InvalidInput(
                f"{FIELD_PREFIX}.{unknown[0]}: unknown setting (known: {', '.join(sorted(known))})"
            )
        values: dict[str, Any] = {}
        if "transport" in extra:
            values["transport"] = _transport(extra["transport"])
        if "auth_token_file" in extra:
            values["auth_token"] = _read_token(extra["auth_token_file"])
        if "control_host" in extra:
            host = extra["control_host"]
            if not isinstance(host, str) or not host or any(c.isspace() for c in host):
                raise InvalidInput(f"{FIELD_PREFIX}.control_host: not a host name, got {host!r}")
            values["control_host"] = host
        if "control_port" in extra:
            port = extra["control_port"]
            if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
                raise InvalidInput(
                    f"{FIELD_PREFIX}.control_port: not a port in [0, 65535], got {port!r}"
                )
            values["control_port"] = port
        for name in ("lease_s", "control_timeout_s"):
            if name in extra:
                values[name] = _positive_seconds(name, extra[name])
        if "test_hold_loads_file" in extra:
            path = extra["test_hold_loads_file"]
            if not isinstance(path, str) or not path:
                raise InvalidInput(
                    f"{FIELD_PREFIX}.test_hold_loads_file: not a file path, got {path!r}"
                )
            values["test_hold_loads_file"] = path
        if "verify" in extra:
            if not isinstance(extra["verify"], bool):
                raise InvalidInput(f"{FIELD_PREFIX}.verify: not true or false")
            values["verify"] = extra["verify"]
        return cls(**values)


def _positive_seconds(name: str, value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise InvalidInput(
            f"{FIELD_PREFIX}.{name}: not a positive number of seconds, got {value!r}"
        )
    return float(value)


def _transport(value: Any) -> TransportKind:
    try:
        return TransportKind(value)
    except ValueError:
        choices = " | ".join(t.value for t in TransportKind)
        raise InvalidInput(f"{FIELD_PREFIX}.transport: {value!r} is not one of {choices}") from None


def _read_token(value: Any) -> str:
    name = f"{FIELD_PREFIX}.auth_token_file"
    if not isinstance(value, str) or not value:
        raise InvalidInput(f"{name}: not a file path, got {value!r}")
    try:
        token = Path(value).read_text().strip()
    except OSError as exc:
        raise InvalidInput(f"{name}: cannot read {value!r} ({exc.strerror})") from None
    if not token or any(c.isspace() or not c.isprintable() for c in token):
        raise InvalidInput(f"{name}: {value!r} must hold one non-empty token without spaces")
    return token


def compat_fields(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> dict[str, str]:
    """What a prefill and a decode instance must agree on, whatever their TP sizes.

    geometry: a digest of the model's hf config (both sides load the same checkpoint);
    block_size and per-group specs (kind, block size, dtypes, layers): how vLLM pages the cache;
    layout: vLLM's layout switches (conv-state and KV layouts). Per-rank shapes stay out: they
    differ between TP sizes, and the per-rank layouts in the handshake carry them.
    """
    hf_config = vllm_config.model_config.hf_config
    hf_json = json.dumps(hf_config.to_dict(), sort_keys=True, default=str)
    groups = [_group_fields(group) for group in kv_cache_config.transfer_groups]
    cache = vllm_config.cache_config
    dtypes = {
        "model": str(vllm_config.model_config.dtype),
        "cache": str(cache.cache_dtype),
        "mamba": str(cache.mamba_cache_dtype),
        "mamba_ssm": str(cache.mamba_ssm_cache_dtype),
        "groups": [g.pop("dtypes") for g in groups],
    }
    layout = {name: os.environ.get(name, "default") for name in LAYOUT_ENV_VARS}
    return make_compat(
        geometry=hashlib.sha256(hf_json.encode()).hexdigest()[:32],
        dtypes=json.dumps(dtypes, sort_keys=True),
        block_size=cache.block_size,
        layout_version=LAYOUT_VERSION,
        groups=json.dumps(groups, sort_keys=True),
        vllm_layout=json.dumps(layout, sort_keys=True),
    )


def _group_fields(group: Any) -> dict[str, Any]:
    spec = group.kv_cache_spec
    dtypes = getattr(spec, "dtypes", None) or (getattr(spec, "dtype", None),)
    return {
        "kind": type(spec).__name__,
        "block_size": spec.block_size,
        "dtypes": [str(d) for d in dtypes],
        "layers": list(group.layer_names),
    }
