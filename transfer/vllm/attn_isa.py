"""Which attention kernel vLLM runs on each attention layer, and whether pdxfer reads the KV
block layout that kernel writes.

vLLM's CPU attention backend (`CPU_ATTN`) picks a kernel ("ISA") per cache group when it
builds the group's metadata builder, before the connector sees the caches
(`cpu_attn._get_attn_isa`: `amx` for bf16 on CPUs with AMX tiles, `neon` on Arm, `vec16` for
head sizes that are a multiple of 16 but not of 32, `rvv` / `vxe` / `vsx` on RISC-V / s390x /
POWER, else `vec`) and sets it on every layer as `layer.isa`. The kernels lay a block out
differently: `vec` keeps a head's K dim-major (`[head_size][block_size]`) then its V
token-major (`[block_size][head_size]`), which is what `layout_vllm` describes; `amx` packs K
and V into tiles. MLA layers run `CPU_MLA` (`[blocks, block_size, latent]`) unless the CPU
has AMX, where vLLM picks `AMX_MLA`.

A prefill and a decode on different kernels would also disagree on the bytes of a block, so
a kernel that is not known here is refused at start-up, naming it and its layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from transfer.errors import InvalidInput


@dataclass(frozen=True)
class AttentionKernel:
    """An attention layer's vLLM backend (`get_name()`) and, for CPU_ATTN, its ISA."""

    backend: str
    isa: str | None = None

    def __str__(self) -> str:
        return self.backend if self.isa is None else f"{self.backend} isa={self.isa!r}"


# The kernels whose KV block layout `layout_vllm` describes (tested with real vLLM: vec).
READ_KERNELS = frozenset({AttentionKernel("CPU_ATTN", "vec"), AttentionKernel("CPU_MLA")})


def layer_kernel(layer: Any) -> AttentionKernel:
    """The kernel of one vLLM attention layer (its `isa` is set once vLLM has built the
    layer's metadata builder, which it does before registering the caches)."""
    backend = layer.get_attn_backend().get_name()
    return AttentionKernel(backend, getattr(layer, "isa", None))


def check_kernels(kernels: Mapping[str, AttentionKernel]) -> None:
    """InvalidInput naming every kernel of `kernels` (layer name -> kernel) whose layout
    pdxfer does not read, with its layers."""
    unread: dict[AttentionKernel, list[str]] = {}
    for name, kernel in kernels.items():
        if kernel not in READ_KERNELS:
            unread.setdefault(kernel, []).append(name)
    if unread:
        found = "; ".join(
            f"{kernel} on {', '.join(sorted(names))}" for kernel, names in unread.items()
        )
        read = ", ".join(sorted(str(k) for k in READ_KERNELS))
        raise InvalidInput(
            f"vLLM attention kernel: {found}: pdxfer does not read the KV block layout of "
            f"this kernel (it reads {read})"
        )


def attention_layer_names(kv_cache_config: Any) -> list[str]:
    """vLLM's names of the layers whose cache spec is an attention spec (MLA included)."""
    from vllm.v1.kv_cache_interface import AttentionSpec, UniformTypeKVCacheSpecs

    names = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        for name in group.layer_names:
            layer_spec = (
                spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec
            )
            if isinstance(layer_spec, AttentionSpec):
                names.append(name)
    return names


def check_attention_layers(vllm_config: Any, kv_cache_config: Any) -> None:
    """Refuse (InvalidInput) the served model's attention kernels that pdxfer does not
    read; call once vLLM has built its metadata builders (at `register_kv_caches`)."""
    layers = vllm_config.compilation_config.static_forward_context
    names = attention_layer_names(kv_cache_config)
    check_kernels({name: layer_kernel(layers[name]) for name in names})
