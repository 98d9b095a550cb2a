"""`pdxfer plan --transfer`: plan one request's transfer between fresh prefill/decode pools."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from transfer.cache import CachePools, Layout
from transfer.memplan import MemoryPlan, plan_memory
from transfer.packer import TransferPlan, TransferRequest, plan_transfer
from transfer.presets import load_geometry
from transfer.sizing import CacheDtypes
from transfer.units import format_bytes, parse_size

STAGING_BYTES = 64 * 2**20  # per rank, inside the arena


def _instance(args: argparse.Namespace, geometry, tp: int, dtypes: CacheDtypes, field: str):
    if tp < 1:
        raise ValueError(f"{field} must be >= 1, got {tp}")
    geometry.check_tp(tp)
    if not 0.0 < args.mem_fraction <= 1.0:
        raise ValueError(f"--mem-fraction must be in (0, 1], got {args.mem_fraction}")
    budget = int(parse_size(args.gpu_mem, "--gpu-mem") * args.mem_fraction)
    plan = plan_memory(
        geometry,
        tp,
        budget,
        args.max_seqs,
        block_size=args.block_size,
        spec_tokens=args.spec_tokens,
        page_policy=args.page_policy,
        placement=args.placement,
        dtypes=dtypes,
    )
    layouts = Layout.from_memplan(geometry, tp, 0, plan, dtypes, staging_bytes=STAGING_BYTES)
    pools = CachePools.from_plan(plan, spec_slots_per_request=args.spec_tokens)
    return plan, layouts.all_ranks(), pools.allocate("request-0", args.tokens)


def transfer_report(
    model: str,
    plans: tuple[TransferPlan, ...],
    p_plan: MemoryPlan,
    d_plan: MemoryPlan,
    prefill: tuple[Layout, ...],
    request: TransferRequest,
) -> dict[str, Any]:
    """The `--json` document. Its keys are a public interface."""
    options = prefill[0].options
    return {
        "model": model,
        "tokens": request.num_tokens,
        "prefill_tp": len(prefill),
        "decode_tp": len(plans),
        "prefill_block_size": p_plan.block_size,
        "decode_block_size": d_plan.block_size,
        "prefill_blocks": len(request.src_blocks),
        "decode_blocks": len(request.dst_blocks),
        "slots_per_request": len(request.dst_slots),
        "layout": {k: getattr(options, k).value for k in ("kv_order", "ssm_order", "conv_order")}
        | {"state_placement": p_plan.placement.value},
        "decode_ranks": [plan.report() for plan in plans],
        "total_wire_bytes": sum(p.wire_bytes for p in plans),
        "total_useful_bytes": sum(p.useful_bytes for p in plans),
        "total_descriptors": sum(p.descriptors for p in plans),
        "naive_descriptors": sum(p.naive_descriptors for p in plans),
    }


def format_transfer(report: dict[str, Any]) -> str:
    r = report
    lines = [
        f"{r['model']}: {r['tokens']:,} tokens, prefill TP {r['prefill_tp']} "
        f"({r['prefill_blocks']} blocks of {r['prefill_block_size']}) -> decode TP "
        f"{r['decode_tp']} ({r['decode_blocks']} blocks of {r['decode_block_size']})",
        "layout: " + ", ".join(f"{k} {v}" for k, v in r["layout"].items()),
        "",
    ]
    for rank in r["decode_ranks"]:
        lines.append(
            f"decode rank {rank['rank']}: kv {format_bytes(rank['kv_bytes'])} + state "
            f"{format_bytes(rank['state_bytes'])}, {rank['descriptors']} descriptors "
            f"(naive {rank['naive_descriptors']})"
        )
        for source in rank["sources"]:
            lines.append(
                f"  <- prefill rank {source['prefill_rank']}: {format_bytes(source['bytes'])} in "
                f"{source['descriptors']} descriptors; {source['reason']}"
            )
    wire, useful = r["total_wire_bytes"], r["total_useful_bytes"]
    lines += [
        "",
        f"wire bytes   {format_bytes(wire)} ({wire:,} B; useful {useful:,} B)",
        f"descriptors  {r['total_descriptors']:,} (naive, one per layer x block x K/V region "
        f"as vLLM's NixlConnector posts: {r['naive_descriptors']:,})",
    ]
    return "\n".join(lines)


def run_transfer_plan(args: argparse.Namespace) -> int:
    if args.tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {args.tokens}")
    geometry = load_geometry(
        args.model or (None if args.hf_config else "qwen3-next-80b-a3b"), args.hf_config
    )
    dtypes = CacheDtypes.for_model(geometry, args.ssm_dtype)
    p_plan, prefill, src = _instance(args, geometry, args.prefill_tp, dtypes, "--prefill-tp")
    d_plan, decode, dst = _instance(args, geometry, args.decode_tp, dtypes, "--decode-tp")
    request = TransferRequest(args.tokens, src.block_ids, src.slot_ids, dst.block_ids, dst.slot_ids)
    plans = plan_transfer(prefill, decode, request)
    report = transfer_report(geometry.name, plans, p_plan, d_plan, prefill, request)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        print(format_transfer(report))
    return 0
