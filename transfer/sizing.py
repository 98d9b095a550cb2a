"""Cache bytes per layer and per model on one TP rank (docs/reference.md #2)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from transfer.errors import InvalidInput
from transfer.geometry import DTYPE_BYTES as DTYPE_BYTES_BY_NAME
from transfer.geometry import CacheTensor, LayerSpec, ModelGeometry, Role, canonical_dtype

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}


@dataclass(frozen=True)
class CacheDtypes:
    """Element sizes in bytes: KV cache, recurrent state (S), conv window."""

    kv: int = 2
    ssm: int = 2
    conv: int = 2

    @classmethod
    def from_names(cls, kv: str = "bf16", ssm: str = "bf16", conv: str = "bf16") -> CacheDtypes:
        for field, name in (("kv_dtype", kv), ("state_dtype", ssm), ("conv_dtype", conv)):
            if name not in DTYPE_BYTES:
                raise InvalidInput(
                    f"{field} {name!r} unknown; choose from {', '.join(DTYPE_BYTES)}"
                )
        return cls(DTYPE_BYTES[kv], DTYPE_BYTES[ssm], DTYPE_BYTES[conv])

    @classmethod
    def for_model(cls, geometry: ModelGeometry, ssm_dtype: str = "auto") -> CacheDtypes:
        """KV and conv in the model's dtype; S in `ssm_dtype`, where "auto" means the
        config's mamba_ssm_dtype if it has one, else the model dtype (as vLLM does)."""
        model = DTYPE_BYTES_BY_NAME[geometry.dtype]
        if ssm_dtype == "auto":
            ssm = DTYPE_BYTES_BY_NAME[geometry.ssm_dtype or geometry.dtype]
        else:
            ssm = DTYPE_BYTES_BY_NAME[canonical_dtype(ssm_dtype, "ssm_dtype")]
        return cls(kv=model, ssm=ssm, conv=model)

    def of(self, role: Role) -> int:
        return {Role.KV: self.kv, Role.SSM: self.ssm, Role.CONV: self.conv}[role]


def tensor_bytes(tensor: CacheTensor, tp: int, dtypes: CacheDtypes) -> int:
    """Bytes of `tensor` on one rank: per token for KV, per state slot otherwise."""
    return tensor.rank_elems(tp) * dtypes.of(tensor.role)


@dataclass(frozen=True)
class LinearStateBytes:
    ssm: int
    conv: int

    @property
    def total(self) -> int:
        return self.ssm + self.conv


def linear_state_bytes(layer: LayerSpec, tp: int, dtypes: CacheDtypes) -> LinearStateBytes:
    """S and Conv bytes of one linear layer for one state slot on one rank."""
    layer.check_tp(tp)
    ssm = conv = 0
    for tensor in layer.cache_tensors():
        if tensor.role is Role.SSM:
            ssm += tensor_bytes(tensor, tp, dtypes)
        elif tensor.role is Role.CONV:
            conv += tensor_bytes(tensor, tp, dtypes)
    return LinearStateBytes(ssm, conv)


def attention_kv_bytes_per_token(layer: LayerSpec, tp: int, dtypes: CacheDtypes) -> int:
    """KV bytes per token of one attention layer on one rank (never below one whole head)."""
    layer.check_tp(tp)
    return sum(tensor_bytes(t, tp, dtypes) for t in layer.cache_tensors() if t.role is Role.KV)


@dataclass(frozen=True)
class ModelSizing:
    """Whole-model cache bytes on one rank."""

    tp: int
    spec_tokens: int
    linear_layer_state: LinearStateBytes | None  # the first linear layer's S and Conv
    attention_layer_kv_per_token: int | None  # the first attention layer's bytes per token
    state_bytes_per_slot: int  # all linear layers, one slot
    state_bytes_per_request: int  # all linear layers, (1 + spec_tokens) slots
    kv_bytes_per_token: int  # all attention layers
    crossover_tokens: int | None

    def request_bytes(self, seq_len: int) -> int:
        return self.state_bytes_per_request + seq_len * self.kv_bytes_per_token


def crossover_tokens(state: LinearStateBytes, kv_per_token: int) -> int:
    """Smallest sequence length at which one attention layer outgrows one linear layer."""
    return math.ceil(state.total / kv_per_token)


def size_model(
    geometry: ModelGeometry, tp: int, dtypes: CacheDtypes | None = None, spec_tokens: int = 0
) -> ModelSizing:
    dtypes = dtypes or CacheDtypes()
    if spec_tokens < 0:
        raise InvalidInput(f"spec_tokens must be >= 0, got {spec_tokens}")
    geometry.check_tp(tp)
    linear = [linear_state_bytes(layer, tp, dtypes) for layer in geometry.linear_layers]
    attention = [
        attention_kv_bytes_per_token(layer, tp, dtypes) for layer in geometry.attention_layers
    ]
    per_slot = sum(s.total for s in linear)
    first_linear = linear[0] if linear else None
    first_attention = attention[0] if attention else None
    crossover = None
    if first_linear and first_attention:
        crossover = crossover_tokens(first_linear, first_attention)
    return ModelSizing(
        tp=tp,
        spec_tokens=spec_tokens,
        linear_layer_state=first_linear,
        attention_layer_kv_per_token=first_attention,
        state_bytes_per_slot=per_slot,
        state_bytes_per_request=per_slot * (1 + spec_tokens),
        kv_bytes_per_token=sum(attention),
        crossover_tokens=crossover,
    )
