"""`bench serve`'s report: the table per concurrency, the hop table of a traced run, the
throughput ratios, and the plot."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from transfer.bench.hops import Hop, format_hops

COLUMNS = (  # (title, width, the result's value, format)
    ("conc", 5, lambda r: r["concurrency"], "d"),
    ("tok/s", 9, lambda r: r["output_tokens_per_s"], ".1f"),
    ("ttft p50", 9, lambda r: r["ttft_ms"]["p50"], ".1f"),
    ("ttft p99", 9, lambda r: r["ttft_ms"]["p99"], ".1f"),
    ("itl p50", 8, lambda r: r["itl_ms"]["p50"], ".1f"),
    ("e2e p50", 8, lambda r: r["e2e_ms"]["p50"], ".1f"),
    ("xfer p50", 8, lambda r: r["transfer_ms"]["p50"], ".2f"),
    ("batch", 6, lambda r: r["decode_batch_mean"], ".1f"),
    ("failed", 6, lambda r: r["failed"], "d"),
    ("cpu ms/tok decode", 17, lambda r: r["decode_cpu_ms_per_token"], ".2f"),
    ("control", 7, lambda r: r["decode_control_cpu_ms_per_token"], ".2f"),
    ("router", 6, lambda r: r["router_cpu_ms_per_token"], ".2f"),
)


def format_report(report: dict, levels: list[int], hops: Mapping[str, Sequence[Hop]]) -> str:
    """A row per concurrency, the hops per level of a traced run (`format_hops`), and the
    throughput ratios to the first level."""
    lines = [" ".join(f"{title:>{width}}" for title, width, _, _ in COLUMNS)]
    for r in report["results"]:
        lines.append(" ".join(f"{value(r):>{width}{spec}}" for _, width, value, spec in COLUMNS))
    if report["rounds"] > 1:
        lines.append(f"(medians over {report['rounds']} rounds)")
    if hops:
        lines.append(format_hops(hops))
    for level, ratios in report["throughput_ratios"].items():
        each = ", ".join(f"{x:.2f}x" for x in ratios)
        lines.append(
            f"tok/s at C={level} over C={levels[0]}: median {statistics.median(ratios):.2f}x"
            f" (rounds: {each})"
        )
    return "\n".join(lines)


def plot_results(results: list[dict], path: str, title: str) -> None:
    """A PNG at `path`: tok/s, and TTFT, ITL and end-to-end p50, against concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [r["concurrency"] for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    left.plot(levels, [r["output_tokens_per_s"] for r in results], marker="o")
    left.set_xlabel("concurrency")
    left.set_ylabel("output tokens/s")
    left.set_xscale("log", base=2)
    for key, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "end to end")):
        right.plot(levels, [r[key]["p50"] for r in results], marker="o", label=f"{label} p50")
    right.set_xlabel("concurrency")
    right.set_ylabel("ms")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
