"""Plots for `pdxfer plan --plot` (matplotlib, headless)."""

from __future__ import annotations

from transfer.sizing import ModelSizing


def plot_crossover(
    model: str, sizing: ModelSizing, path: str, max_tokens: int | None = None
) -> None:
    """Cache bytes of one request against sequence length: one linear layer, one attention
    layer and the whole model, with the crossover marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    crossover = sizing.crossover_tokens
    max_tokens = max_tokens or max(4096, 4 * (crossover or 1024))
    lengths = list(range(1, max_tokens + 1, max(1, max_tokens // 256)))
    fig, ax = plt.subplots(figsize=(8, 5))
    if sizing.linear_layer_state:
        state = sizing.linear_layer_state.total
        ax.plot(lengths, [state / 2**20] * len(lengths), label="one linear layer (S + conv)")
    if sizing.attention_layer_kv_per_token:
        kv = sizing.attention_layer_kv_per_token
        ax.plot(lengths, [n * kv / 2**20 for n in lengths], label="one attention layer (KV)")
    ax.plot(
        lengths,
        [sizing.request_bytes(n) / 2**20 for n in lengths],
        label="whole model",
        linestyle="--",
    )
    if crossover:
        ax.axvline(crossover, color="grey", linestyle=":")
        ax.annotate(
            f"crossover {crossover} tokens",
            (crossover, sizing.request_bytes(crossover) / 2**20),
            textcoords="offset points",
            xytext=(5, 10),
        )
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("cache bytes per request, one rank (MiB)")
    ax.set_title(f"{model}, TP={sizing.tp}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
