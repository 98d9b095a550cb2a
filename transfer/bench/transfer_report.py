"""Output of `pdxfer bench transfer`: the text table, the CSV and the plot."""

from __future__ import annotations

import csv
from collections.abc import Sequence

CSV_COLUMNS = (
    "model",
    "layers",
    "transport",
    "nodes",
    "prefill_tp",
    "decode_tp",
    "tokens",
    "bytes",
    "kv_bytes",
    "state_bytes",
    "median_ms",
    "p99_ms",
    "gbps",
    "raw_median_ms",
    "raw_p99_ms",
    "raw_gbps",
    "naive_median_ms",
    "naive_p99_ms",
    "naive_gbps",
    "efficiency",
    "speedup",
    "descriptors",
    "raw_descriptors",
    "naive_descriptors",
    "staged_sources",
    "lowest_median_ms",
    "lowest_p99_ms",
    "lowest_gbps",
    "lowest_efficiency",
    "lowest_descriptors",
    "prefill_block_runs",
    "decode_block_runs",
    "lowest_prefill_block_runs",
    "lowest_decode_block_runs",
    "exposed_ms",
    "exposed_p99_ms",
    "whole_exposed_ms",
    "exposed_ratio",
    "prefill_ms",
    "stream_groups",
    "stream_parts",
    "stream_descriptors",
    "groups_gbps",
    "groups_efficiency",
)


def _rows(report: dict) -> list[dict]:
    fixed = {k: report[k] for k in ("model", "layers", "transport", "nodes")}
    return [{**fixed, **result} for result in report["results"]]


def write_csv(report: dict, path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in _rows(report):
            writer.writerow({k: f"{v:.4g}" if isinstance(v, float) else v for k, v in row.items()})


def format_table(report: dict) -> str:
    lines = [
        f"pdxfer bench transfer: {report['model']} ({report['layers']} of {report['model_layers']} "
        f"cache layers), {report['transport']}, {report['nodes']}, block size {report['block_size']}, "
        f"{report['repeats']} repeats",
        f"{'P':>2} {'D':>2} {'tokens':>7} {'bytes':>10} {'median':>9} {'p99':>9} {'GB/s':>6} "
        f"{'raw':>6} {'naive':>6} {'eff':>5} {'speedup':>7} {'desc':>6} {'naive desc':>10} "
        f"{'old GB/s':>8} {'old eff':>7} {'old desc':>8}",
    ]
    for r in report["results"]:
        lines.append(
            f"{r['prefill_tp']:>2} {r['decode_tp']:>2} {r['tokens']:>7} {r['bytes'] / 2**20:>6.1f} MiB "
            f"{r['median_ms']:>6.1f} ms {r['p99_ms']:>6.1f} ms {r['gbps']:>6.2f} {r['raw_gbps']:>6.2f} "
            f"{r['naive_gbps']:>6.2f} {r['efficiency']:>5.2f} {r['speedup']:>6.2f}x "
            f"{r['descriptors']:>6} {r['naive_descriptors']:>10} "
            f"{r.get('lowest_gbps', float('nan')):>8.2f} "
            f"{r.get('lowest_efficiency', float('nan')):>7.2f} {r.get('lowest_descriptors', '-'):>8}"
        )
        if "exposed_ms" in r:
            lines.append(
                f"      layer-wise ({r['stream_groups']} groups, {r['stream_parts']} parts, "
                f"{r['stream_descriptors']} desc): "
                f"exposed {r['exposed_ms']:.1f} ms vs whole {r['whole_exposed_ms']:.1f} ms "
                f"(ratio {r['exposed_ratio']:.3f}) after a {r['prefill_ms']:.0f} ms modelled "
                f"prefill; all groups at once {r['groups_gbps']:.2f} GB/s "
                f"(eff {r['groups_efficiency']:.2f})"
            )
    control = report.get("control")
    if control:
        lines.append(
            f"control plane (Acquire + Release, loopback): p50 {control['p50_ms']:.3f} ms, "
            f"p99 {control['p99_ms']:.3f} ms serial; {control['tickets_per_s']:.0f} tickets/s "
            f"with {control['concurrency']} clients (p99 {control['loaded_p99_ms']:.3f} ms)"
        )
    lines.append(
        "GB/s = bytes / median time (1 GB = 1e9 B); eff = ours / raw; speedup = ours / naive; "
        "old = the same request placed by the lowest-free-first block pool"
    )
    return "\n".join(lines)


def _pairs(results: Sequence[dict]) -> list[tuple[int, int]]:
    return sorted({(r["prefill_tp"], r["decode_tp"]) for r in results})


def _tokens_label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def plot(report: dict, path: str) -> None:
    """Three panels against tokens: throughput (ours, raw, naive), descriptors (ours,
    naive), efficiency (with the goals)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    ticks = sorted({r["tokens"] for r in results})
    layerwise = all("exposed_ms" in r for r in results)
    fig, axes = plt.subplots(1, 4 if layerwise else 3, figsize=(20 if layerwise else 15, 4.6))
    speed, descs, eff = axes[:3]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (p, d) in enumerate(_pairs(results)):
        rows = sorted(
            (r for r in results if (r["prefill_tp"], r["decode_tp"]) == (p, d)),
            key=lambda r: r["tokens"],
        )
        tokens = [r["tokens"] for r in rows]
        color, label = colors[i % len(colors)], f"P={p} D={d}"
        speed.plot(tokens, [r["gbps"] for r in rows], "o-", color=color, label=f"{label} ours")
        speed.plot(tokens, [r["raw_gbps"] for r in rows], "^--", color=color, label=f"{label} raw")
        speed.plot(
            tokens, [r["naive_gbps"] for r in rows], "x:", color=color, label=f"{label} naive"
        )
        descs.plot(
            tokens, [r["descriptors"] for r in rows], "o-", color=color, label=f"{label} ours"
        )
        if all("lowest_descriptors" in r for r in rows):
            descs.plot(
                tokens,
                [r["lowest_descriptors"] for r in rows],
                "s--",
                color=color,
                label=f"{label} lowest-first",
            )
        descs.plot(
            tokens,
            [r["naive_descriptors"] for r in rows],
            "x:",
            color=color,
            label=f"{label} naive",
        )
        eff.plot(tokens, [r["efficiency"] for r in rows], "o-", color=color, label=label)
        if layerwise:
            axes[3].plot(
                tokens,
                [r["exposed_ms"] for r in rows],
                "o-",
                color=color,
                label=f"{label} layer-wise",
            )
            axes[3].plot(
                tokens,
                [r["whole_exposed_ms"] for r in rows],
                "s--",
                color=color,
                label=f"{label} whole request",
            )
    for goal, style in ((0.9, "-"), (0.8, "--")):
        eff.axhline(goal, color="grey", linestyle=style, linewidth=0.8)
    panels = [
        (speed, "throughput", "GB/s (median)"),
        (descs, "descriptors per request", "descriptors"),
        (eff, "efficiency = ours / raw (goals 0.9, hetero 0.8)", "efficiency"),
    ]
    if layerwise:
        stream = report.get("stream_layers")
        title = f"exposed transfer after the modelled prefill ({stream} layers per group)"
        panels.append((axes[3], title, "ms (median)"))
    for ax, title, ylabel in panels:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [_tokens_label(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("tokens")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
    descs.set_yscale("log")
    speed.legend(fontsize=6, ncol=2)
    descs.legend(fontsize=6, ncol=2)
    eff.legend(fontsize=7)
    if layerwise:
        axes[3].set_yscale("log")
        axes[3].legend(fontsize=6)
    fig.suptitle(
        f"{report['model']} ({report['layers']}/{report['model_layers']} layers), "
        f"{report['transport']}, {report['nodes']}",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
