"""Model geometry: which layers a hybrid model has, what each caches, and how TP shards it.

Every cache tensor is described the same way, so the sizing, layout and packer code never
special-case a model family: a tensor is a concatenation of *segments* along one channel
axis (for conv state: q|k|v or x|B|C), each segment a run of `num_units` heads or groups of
`unit_elems` elements, repeated over `steps` (conv window) and, for KV, over tokens.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from transfer.errors import InvalidInput

# Element sizes of the dtypes a cache may hold, by torch name; config.json spellings map here.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_DTYPE_ALIASES = {
    "fp32": "float32", "float": "float32", "torch.float32": "float32",
    "bf16": "bfloat16", "torch.bfloat16": "bfloat16",
    "fp16": "float16", "half": "float16", "torch.float16": "float16",
}  # fmt: skip


def canonical_dtype(name: object, field: str = "dtype") -> str:
    """The torch name ("float32", "bfloat16", "float16") of a dtype spelling; InvalidInput
    naming `field` for anything else."""
    text = str(name).lower() if isinstance(name, str) else None
    canonical = _DTYPE_ALIASES.get(text, text)
    if canonical not in DTYPE_BYTES:
        raise InvalidInput(f"{field}: dtype {name!r} unknown; choose from {', '.join(DTYPE_BYTES)}")
    return canonical


class LayerKind(str, enum.Enum):
    GQA = "gqa"
    MLA = "mla"
    GDN = "gdn"
    KDA = "kda"
    MAMBA2 = "mamba2"

    @property
    def is_linear(self) -> bool:
        return self in (LayerKind.GDN, LayerKind.KDA, LayerKind.MAMBA2)


class Sharding(str, enum.Enum):
    SPLIT = "split"  # units divided evenly over ranks; tp must divide num_units
    SPLIT_OR_REPLICATE = "split_or_replicate"  # fewer units than ranks: each unit on tp/units ranks
    REPLICATED = "replicated"  # every rank holds every unit (MLA latent)


class Role(str, enum.Enum):
    KV = "kv"  # per token, paged in blocks
    SSM = "ssm"  # recurrent state, per request
    CONV = "conv"  # short-conv window, per request


@dataclass(frozen=True)
class Segment:
    """`num_units` heads/groups of `unit_elems` elements each, sharded as `sharding` says."""

    name: str
    num_units: int
    unit_elems: int
    sharding: Sharding = Sharding.SPLIT

    def units_on_rank(self, tp: int, rank: int) -> range:
        """Global unit indices that rank `rank` of `tp` holds (assumes `check_tp` passed)."""
        if self.sharding is Sharding.REPLICATED:
            return range(self.num_units)
        if self.num_units >= tp:
            per_rank = self.num_units // tp
            return range(rank * per_rank, (rank + 1) * per_rank)
        ranks_per_unit = tp // self.num_units
        unit = rank // ranks_per_unit
        return range(unit, unit + 1)

    def ranks_holding(self, unit: int, tp: int) -> range:
        """The ranks of `tp` that hold global unit `unit`."""
        if self.sharding is Sharding.REPLICATED:
            return range(tp)
        if self.num_units >= tp:
            rank = unit // (self.num_units // tp)
            return range(rank, rank + 1)
        ranks_per_unit = tp // self.num_units
        return range(unit * ranks_per_unit, (unit + 1) * ranks_per_unit)

    def units_per_rank(self, tp: int) -> int:
        return len(self.units_on_rank(tp, 0))

    def check_tp(self, tp: int) -> str | None:
        """None when `tp` can shard this segment, else why not."""
        if self.sharding is Sharding.REPLICATED:
            return None
        if self.num_units >= tp and self.num_units % tp == 0:
            return None
        if self.sharding is Sharding.SPLIT_OR_REPLICATE and tp % self.num_units == 0:
            return None
        return f"tp={tp} does not divide the {self.num_units} {self.name}"


@dataclass(frozen=True)
class CacheTensor:
    """One cached tensor of a layer: segments concatenated on the channel axis, times `steps`.

    KV tensors hold one `[channels]` row per token; SSM holds `[channels]` with the per-head
    matrix flattened into `unit_elems`; CONV holds `[channels, steps]` (the last W-1 inputs).
    """

    name: str
    role: Role
    segments: tuple[Segment, ...]
    steps: int = 1

    @property
    def channels(self) -> int:
        return sum(s.num_units * s.unit_elems for s in self.segments)

    def rank_channels(self, tp: int) -> int:
        return sum(s.units_per_rank(tp) * s.unit_elems for s in self.segments)

    def rank_elems(self, tp: int) -> int:
        """Elements on one rank: per token for KV, per request slot otherwise."""
        return self.rank_channels(tp) * self.steps


@dataclass(frozen=True)
class GQASpec:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    kind = LayerKind.GQA

    def cache_tensors(self) -> tuple[CacheTensor, ...]:
        heads = Segment("kv_heads", self.num_kv_heads, self.head_dim, Sharding.SPLIT_OR_REPLICATE)
        return (CacheTensor("k", Role.KV, (heads,)), CacheTensor("v", Role.KV, (heads,)))

    def compute_segments(self) -> tuple[Segment, ...]:
        return (Segment("q_heads", self.num_q_heads, self.head_dim),)


@dataclass(frozen=True)
class MLASpec:
    num_q_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    kind = LayerKind.MLA

    def cache_tensors(self) -> tuple[CacheTensor, ...]:
        latent = Segment(
            "latent", 1, self.kv_lora_rank + self.qk_rope_head_dim, Sharding.REPLICATED
        )
        return (CacheTensor("kv", Role.KV, (latent,)),)

    def compute_segments(self) -> tuple[Segment, ...]:
        return (Segment("q_heads", self.num_q_heads, self.qk_nope_head_dim),)


@dataclass(frozen=True)
class GDNSpec:
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    kind = LayerKind.GDN

    def cache_tensors(self) -> tuple[CacheTensor, ...]:
        ssm = Segment("v_heads", self.num_v_heads, self.head_k_dim * self.head_v_dim)
        conv = (
            Segment("q", self.num_k_heads, self.head_k_dim),
            Segment("k", self.num_k_heads, self.head_k_dim),
            Segment("v", self.num_v_heads, self.head_v_dim),
        )
        return (
            CacheTensor("ssm", Role.SSM, (ssm,)),
            CacheTensor("conv", Role.CONV, conv, steps=self.conv_kernel - 1),
        )

    def compute_segments(self) -> tuple[Segment, ...]:
        return (
            Segment("k_heads", self.num_k_heads, self.head_k_dim),
            Segment("v_heads", self.num_v_heads, self.head_v_dim),
        )


@dataclass(frozen=True)
class KDASpec:
    num_heads: int
    head_dim: int
    conv_kernel: int
    kind = LayerKind.KDA

    def cache_tensors(self) -> tuple[CacheTensor, ...]:
        ssm = Segment("heads", self.num_heads, self.head_dim * self.head_dim)
        steps = self.conv_kernel - 1
        return (CacheTensor("ssm", Role.SSM, (ssm,)),) + tuple(
            CacheTensor(f"conv_{x}", Role.CONV, (Segment(x, self.num_heads, self.head_dim),), steps)
            for x in ("q", "k", "v")
        )

    def compute_segments(self) -> tuple[Segment, ...]:
        return (Segment("heads", self.num_heads, self.head_dim),)


@dataclass(frozen=True)
class Mamba2Spec:
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    kind = LayerKind.MAMBA2

    def cache_tensors(self) -> tuple[CacheTensor, ...]:
        ssm = Segment("heads", self.num_heads, self.head_dim * self.state_size)
        group = Sharding.SPLIT_OR_REPLICATE
        conv = (
            Segment("x", self.num_heads, self.head_dim),
            Segment("B", self.n_groups, self.state_size, group),
            Segment("C", self.n_groups, self.state_size, group),
        )
        return (
            CacheTensor("ssm", Role.SSM, (ssm,)),
            CacheTensor("conv", Role.CONV, conv, steps=self.conv_kernel - 1),
        )

    def compute_segments(self) -> tuple[Segment, ...]:
        return (Segment("heads", self.num_heads, self.head_dim),)


KindSpec = GQASpec | MLASpec | GDNSpec | KDASpec | Mamba2Spec


@dataclass(frozen=True)
class LayerSpec:
    """Layer `index` of the model (its position among all decoder layers) and its dimensions."""

    index: int
    spec: KindSpec

    @property
    def kind(self) -> LayerKind:
        return self.spec.kind

    def cache_tensors(self) -> tuple[CacheTensor, ...]:
        return self.spec.cache_tensors()

    def check_tp(self, tp: int) -> None:
        """Raise ValueError naming this layer and the counts when `tp` cannot shard it."""
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        segments = list(self.spec.compute_segments())
        for tensor in self.cache_tensors():
            segments.extend(tensor.segments)
        for segment in segments:
            problem = segment.check_tp(tp)
            if problem:
                raise ValueError(f"layer {self.index} ({self.kind.value}): {problem}")


@dataclass(frozen=True)
class ModelGeometry:
    """The cache-bearing layers of a model, in order (MLP-only layers cache nothing).

    `dtype` is the model's (KV and conv caches use it); `ssm_dtype` is the recurrent state's
    when the config fixes one (mamba_ssm_dtype), else None: the serving side chooses.
    """

    name: str
    layers: tuple[LayerSpec, ...]
    hidden_size: int
    vocab_size: int = 512
    num_hidden_layers: int = 0
    dtype: str = "bfloat16"
    ssm_dtype: str | None = None

    @property
    def linear_layers(self) -> tuple[LayerSpec, ...]:
        return tuple(layer for layer in self.layers if layer.kind.is_linear)

    @property
    def attention_layers(self) -> tuple[LayerSpec, ...]:
        return tuple(layer for layer in self.layers if not layer.kind.is_linear)

    def check_tp(self, tp: int) -> None:
        for layer in self.layers:
            layer.check_tp(tp)

    def valid_tps(self, candidates: tuple[int, ...] = (1, 2, 4, 8, 16)) -> tuple[int, ...]:
        valid = []
        for tp in candidates:
            try:
                self.check_tp(tp)
            except ValueError:
                continue
            valid.append(tp)
        return tuple(valid)

    def with_num_layers(self, num_layers: int) -> ModelGeometry:
        """The first `num_layers` cache-bearing layers (for benchmarks that must fit a box)."""
        if not 1 <= num_layers <= len(self.layers):
            raise ValueError(f"num_layers must be in [1, {len(self.layers)}], got {num_layers}")
        return dataclasses.replace(
            self, layers=self.layers[:num_layers], num_hidden_layers=num_layers
        )
