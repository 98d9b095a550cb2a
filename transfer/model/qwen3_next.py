"""Qwen3-Next and Qwen3.5 (dense and MoE) causal LMs, one TP rank's shard, from a checkpoint.

Decoder layer i: x += mixer(norm(x)); x += mlp(norm(x)), each sum all-reduced over the TP
group (row-parallel outputs). The mixer is Gated DeltaNet ("linear_attention") or gated
attention ("full_attention"); the MLP is SwiGLU or the sparse MoE. Embedding and LM head are
split by vocabulary rows when TP divides the vocabulary (each rank fills its rows, one
all-reduce assembles them), else replicated.
"""

from __future__ import annotations

import torch

from transfer.errors import InvalidInput
from transfer.geometry import LayerKind, ModelGeometry, Segment
from transfer.hf_geometry import from_hf_dict
from transfer.model.batch import Batch
from transfer.model.checkpoint import Checkpoint
from transfer.model.distributed import TPGroup
from transfer.model.layers.common import AfterLayer, Step
from transfer.model.layers.gated_attention import GatedAttention
from transfer.model.layers.gated_deltanet import GatedDeltaNet
from transfer.model.layers.mlp import SwiGLU
from transfer.model.layers.moe import SparseMoE
from transfer.model.layers.norms import offset_rms_norm
from transfer.model.layers.rope import PartialRope
from transfer.model.qwen_config import QwenConfig, qwen_config
from transfer.model.rank_weights import RankWeights
from transfer.model.row_invariant import linear, row_invariant


class QwenDecoderLayer:
    def __init__(self, mixer, mlp, w: RankWeights, prefix: str, cfg: QwenConfig, tp: TPGroup):
        hidden = (cfg.hidden_size,)
        self.mixer, self.mlp, self.tp, self.eps = mixer, mlp, tp, cfg.rms_norm_eps
        self.input_norm = w.full(prefix + "input_layernorm.weight", hidden)
        self.post_norm = w.full(prefix + "post_attention_layernorm.weight", hidden)

    def __call__(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        x = x + self.tp.all_reduce_(
            self.mixer(offset_rms_norm(x, self.input_norm, self.eps), batch)
        )
        return x + self.tp.all_reduce_(self.mlp(offset_rms_norm(x, self.post_norm, self.eps)))


class QwenHybridLM:
    """TP rank `tp.rank` of a Qwen3-Next / Qwen3.5 checkpoint; `geometry` is its caches'.

    `forward_batch(batch) -> logits [B, vocab]` of each sequence's last token, and the
    per-request `forward(token_ids [T], step) -> logits [vocab]` (a batch of one); fp32 on
    every rank.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        tp: TPGroup,
        device: torch.device | str = "cpu",
        *,
        geometry: ModelGeometry | None = None,
        seed: int | None = None,
    ) -> None:
        source = str(checkpoint.path / "config.json")
        self.config = cfg = qwen_config(checkpoint.config, source)
        self.geometry = geometry or from_hf_dict(checkpoint.config, checkpoint.path.name, source)
        self.geometry.check_tp(tp.size)
        self.tp, self.device, self.seed = tp, torch.device(device), seed
        w = RankWeights(checkpoint, tp.size, tp.rank, self.device)
        hidden, vocab = cfg.hidden_size, cfg.vocab_size
        self.vocab = Segment("vocab", vocab, 1)
        self.vocab_split = self.vocab.check_tp(tp.size) is None and tp.size > 1
        rows = self.vocab.units_on_rank(tp.size, tp.rank) if self.vocab_split else range(vocab)
        self.vocab_rows = rows
        self.embed = self._vocab_rows(w, "model.embed_tokens.weight")
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        if not w.has(head):
            raise InvalidInput(f"model: {checkpoint.path} has no tensor {head!r}")
        self.lm_head = self._vocab_rows(w, head)
        self.final_norm = w.full("model.norm.weight", (hidden,))
        rope = PartialRope(cfg.head_dim, cfg.partial_rotary_factor, cfg.rope_theta, self.device)
        specs = {layer.index: layer for layer in self.geometry.layers}
        self.layers = []
        for i, kind in enumerate(cfg.layer_types):
            p = f"model.layers.{i}."
            spec = specs[i]
            if spec.kind is LayerKind.GDN and kind == "linear_attention":
                mixer = GatedDeltaNet(
                    spec, w, p + "linear_attn.", hidden,
                    grouped=cfg.grouped_gdn, eps=cfg.rms_norm_eps,
                )  # fmt: skip
            elif spec.kind is LayerKind.GQA and kind == "full_attention":
                mixer = GatedAttention(
                    spec, w, p + "self_attn.", hidden,
                    rope=rope, eps=cfg.rms_norm_eps, bias=cfg.attention_bias,
                )  # fmt: skip
            else:
                raise InvalidInput(f"geometry: layer {i} is {spec.kind.value}, config says {kind}")
            if i in cfg.sparse_layers:
                mlp = SparseMoE(w, p + "mlp.", hidden, cfg.moe)
            else:
                mlp = SwiGLU(w, p + "mlp.", hidden, cfg.intermediate_size)
            self.layers.append(QwenDecoderLayer(mixer, mlp, w, p, cfg, tp))

    def _vocab_rows(self, w: RankWeights, name: str) -> torch.Tensor:
        shape = (self.config.vocab_size, self.config.hidden_size)
        if self.vocab_split:
            return w.rows(name, (self.vocab,), shape)
        return w.full(name, shape)

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if not self.vocab_split:
            return self.embed[token_ids]
        local = token_ids - self.vocab_rows.start
        mine = (local >= 0) & (local < len(self.vocab_rows))
        x = self.embed[local.clamp(0, len(self.vocab_rows) - 1)] * mine[:, None]
        return self.tp.all_reduce_(x)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        partial = linear(x, self.lm_head)
        if not self.vocab_split:
            return partial
        logits = x.new_zeros(x.shape[0], self.config.vocab_size)
        logits[:, self.vocab_rows.start : self.vocab_rows.stop] = partial
        return self.tp.all_reduce_(logits)

    @torch.inference_mode()
    def forward_batch(
        self, batch: Batch, all_logits: bool = False, after_layer: AfterLayer | None = None
    ) -> torch.Tensor:
        """The batch's tokens -> fp32 logits [B, vocab] of each sequence's last token
        ([T, vocab] of every token if all_logits); one all-reduce per sublayer for all B.
        `after_layer(i)` runs once layer i has written its caches."""
        with row_invariant(batch.prefill is not None):
            x = self._embed(batch.token_ids)
            for index, layer in enumerate(self.layers):
                x = layer(x, batch)
                if after_layer is not None:
                    after_layer(index)
            if not all_logits:
                x = x[batch.last_tokens]
            return self._logits(offset_rms_norm(x, self.final_norm, self.config.rms_norm_eps))

    def forward(self, token_ids: torch.Tensor, step: Step, all_logits: bool = False):
        """token_ids [T] -> logits [vocab] of the last token ([T, vocab] if all_logits)."""
        logits = self.forward_batch(Batch.from_step(step, token_ids), all_logits)
        return logits if all_logits else logits[0]
