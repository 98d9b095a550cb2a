"""The output of `pdxfer launch`: the per-request table and the `--json` document."""

from __future__ import annotations

from transfer.cli.launch_config import LaunchConfig
from transfer.cli.launch_run import Outcome


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pick(q: float) -> float:
        pos = q * (len(ordered) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return round(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo), 3)

    return {"p50": pick(0.5), "p99": pick(0.99)}


def summarize(outcomes: list[Outcome], config: LaunchConfig, codec=None) -> dict:
    """The `--json` document. Byte and descriptor counts are totals over the requests;
    `codec` (the checkpoint's tokenizer, if any) adds each request's text."""
    good = [o for o in outcomes if not o.error]
    per_request = []
    for index, o in enumerate(outcomes):
        row = {
            "index": index,
            "request_id": o.request_id,
            "prompt_tokens": len(o.prompt),
            "tokens": len(o.tokens),
            "output_token_ids": list(o.tokens),
            "finish_reason": o.finish_reason.value,
            "ttft_ms": round(o.ttft_ms, 3),
            "transfer_ms": round(o.transfer_ms, 3),
            "exposed_transfer_ms": round(o.exposed_transfer_ms, 3),
            "kv_bytes": o.kv_bytes,
            "state_bytes": o.state_bytes,
            "descriptors": o.descriptors,
            "cached_prompt_tokens": o.cached_prompt_tokens,
            "reused_decode_tokens": o.reused_decode_tokens,
            "tokens_per_s": round(o.tokens_per_s, 2),
            "error": o.error,
            "problems": o.problems,
        }
        if codec is not None:
            row["text"] = codec.decode(o.tokens)
        per_request.append(row)
    return {
        "model": config.model,
        "transport": config.transport,
        "prefill_tp": config.prefill_tp,
        "decode_tp": config.decode_tp,
        "transfer_mode": config.transfer_mode,
        "requests": len(outcomes),
        "verify": bool(config.verify),
        "verified": sum(o.ok for o in outcomes) if config.verify else 0,
        "failed": sum(not o.ok for o in outcomes),
        "prompt_len": max((len(o.prompt) for o in outcomes), default=0),
        "max_tokens": config.max_tokens,
        "ignore_eos": bool(config.ignore_eos),
        "kv_bytes": sum(o.kv_bytes for o in good),
        "state_bytes": sum(o.state_bytes for o in good),
        "descriptors": sum(o.descriptors for o in good),
        **_prefix_summary(good),
        "ttft_ms": percentiles([o.ttft_ms for o in good]),
        "transfer_ms": percentiles([o.transfer_ms for o in good]),
        "exposed_transfer_ms": percentiles([o.exposed_transfer_ms for o in good]),
        "tokens_per_s": percentiles([o.tokens_per_s for o in good]),
        "per_request": per_request,
    }


def _prefix_summary(good: list[Outcome]) -> dict:
    """Prefix-cache figures: how many requests hit on each side, the prompt tokens prefill
    did not compute, and the prompt tokens decode did not read."""
    prompt_tokens = sum(len(o.prompt) for o in good)
    cached = sum(o.cached_prompt_tokens for o in good)

    def rate(hits: int) -> float:
        return round(hits / len(good), 4) if good else 0.0

    return {
        "prefix_hit_rate": rate(sum(o.cached_prompt_tokens > 0 for o in good)),
        "decode_reuse_rate": rate(sum(o.reused_decode_tokens > 0 for o in good)),
        "cached_prompt_tokens": cached,
        "computed_prompt_tokens": prompt_tokens - cached,
        "reused_decode_tokens": sum(o.reused_decode_tokens for o in good),
    }


def format_table(outcomes: list[Outcome], summary: dict) -> str:
    header = ("request", "tokens", "ttft ms", "xfer ms", "kv bytes", "state bytes", "descr", "tok/s", "check")  # fmt: skip
    rows = []
    for o in outcomes:
        check = "-" if not summary["verify"] else ("ok" if o.ok else "FAIL")
        if o.error:
            check = "ERROR"
        rows.append((o.request_id, str(len(o.tokens)), f"{o.ttft_ms:.1f}", f"{o.transfer_ms:.2f}",
                     str(o.kv_bytes), str(o.state_bytes), str(o.descriptors),
                     f"{o.tokens_per_s:.1f}", check))  # fmt: skip
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in (header, *rows)]  # fmt: skip
    lines.insert(1, "  ".join("-" * w for w in widths))
    s = summary
    lines.append(
        f"\n{s['requests']} requests, {s['failed']} failed"
        + (f", {s['verified']} verified" if s["verify"] else "")
        + f" | {s['transport']} P={s['prefill_tp']} D={s['decode_tp']}"
        + f" | ttft p50 {s['ttft_ms']['p50']:.1f} ms p99 {s['ttft_ms']['p99']:.1f} ms"
        + f" | transfer p50 {s['transfer_ms']['p50']:.2f} ms p99 {s['transfer_ms']['p99']:.2f} ms"
        + f" | exposed p50 {s['exposed_transfer_ms']['p50']:.2f} ms ({s['transfer_mode']})"
    )
    for o in outcomes:
        for problem in ([o.error] if o.error else []) + o.problems:
            lines.append(f"{o.request_id}: {problem}")
    return "\n".join(lines)
