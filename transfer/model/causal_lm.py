"""The causal-LM shell shared by the checkpoint-built Kimi-Linear and Nemotron-H: embedding,
pre-norm residual sublayers with one all-reduce each, final norm, LM head (all RMSNorms with a
plain weight)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from transfer.geometry import ModelGeometry
from transfer.model.batch import Batch
from transfer.model.distributed import TPGroup
from transfer.model.layers.common import AfterLayer, Step
from transfer.model.layers.norms import rms_normalize
from transfer.model.row_invariant import linear, row_invariant


class Residual:
    """x + all_reduce(fn(rms_norm(x))): fn returns the rank's partial output (row-parallel).
    A `stateless` fn (an MLP) is called without the step; a mixer names its `layer`."""

    def __init__(
        self,
        norm: torch.Tensor,
        eps: float,
        fn: Callable,
        tp: TPGroup,
        *,
        stateless: bool = False,
        layer: int | None = None,
    ) -> None:
        self.norm, self.eps, self.fn, self.tp = norm, eps, fn, tp
        self.stateless = stateless
        self.layer = layer  # the cache-bearing layer whose caches this sublayer writes

    def __call__(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        h = rms_normalize(x, self.eps) * self.norm
        return x + self.tp.all_reduce_(self.fn(h) if self.stateless else self.fn(h, batch))


class CausalLM:
    """One TP rank of a checkpoint-built model (a `RankModel`).

    The embedding and LM head are replicated; every sublayer is column-parallel in and
    row-parallel out, so each rank holds the full hidden state between sublayers.
    """

    seed = None  # weights come from a checkpoint, not from a seed

    def __init__(
        self,
        geometry: ModelGeometry,
        tp: TPGroup,
        device: torch.device | str,
        *,
        embed: torch.Tensor,
        sublayers: Sequence[Residual],
        norm: torch.Tensor,
        eps: float,
        lm_head: torch.Tensor,
    ) -> None:
        self.geometry = geometry
        self.tp = tp
        self.device = torch.device(device)
        self.embed = embed
        self.sublayers = list(sublayers)
        self.norm, self.eps = norm, eps
        self.lm_head = lm_head

    @torch.inference_mode()
    def forward_batch(
        self, batch: Batch, all_logits: bool = False, after_layer: AfterLayer | None = None
    ) -> torch.Tensor:
        """The batch's tokens -> fp32 logits [B, vocab] of each sequence's last token
        ([T, vocab] of every token if all_logits); one all-reduce per sublayer for all B.
        `after_layer(i)` runs once cache-bearing layer i has written its caches."""
        with row_invariant(batch.prefill is not None):
            x = self.embed[batch.token_ids]
            for sublayer in self.sublayers:
                x = sublayer(x, batch)
                if after_layer is not None and sublayer.layer is not None:
                    after_layer(sublayer.layer)
            if not all_logits:
                x = x[batch.last_tokens]
            return linear(rms_normalize(x, self.eps) * self.norm, self.lm_head)

    def forward(self, token_ids: torch.Tensor, step: Step, all_logits: bool = False):
        """token_ids [T] -> fp32 logits [vocab] of the last token ([T, vocab] if all_logits)."""
        logits = self.forward_batch(Batch.from_step(step, token_ids), all_logits)
        return logits if all_logits else logits[0]
