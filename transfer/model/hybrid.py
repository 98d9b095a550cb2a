"""The tiny hybrid model: embedding, decoder layers (norm, mixer, norm, MLP), norm, LM head.

One instance is one TP rank's shard. Weights are drawn at global shapes from `seed` and
sliced, so every TP degree computes the same function (up to fp32 reduction order).
"""

from __future__ import annotations

import torch

from transfer.geometry import LayerKind, ModelGeometry
from transfer.model.distributed import TPGroup
from transfer.model.layers.common import MLP, Step, rms_norm
from transfer.model.layers.gdn import GDNMixer
from transfer.model.layers.gqa import GQAMixer
from transfer.model.layers.kda import KDAMixer
from transfer.model.layers.mla import MLAMixer
from transfer.model.weights import WeightSource

MIXERS = {
    LayerKind.GDN: GDNMixer,
    LayerKind.GQA: GQAMixer,
    LayerKind.KDA: KDAMixer,
    LayerKind.MLA: MLAMixer,
}
MLP_RATIO = 2
# Scales the LM head so the greedy token usually wins by a logit or more, far above the
# ~1e-5 relative drift of fp32 reductions that differ between TP degrees.
LM_HEAD_GAIN = 8.0
MAX_PARAMS = 64_000_000


def num_decoder_layers(geometry: ModelGeometry) -> int:
    last = max((layer.index for layer in geometry.layers), default=-1)
    return max(geometry.num_hidden_layers, last + 1)


def parameter_count(geometry: ModelGeometry) -> int:
    """A rough TP=1 parameter count (embedding, LM head, MLPs, mixer projections)."""
    hidden = geometry.hidden_size
    count = 2 * geometry.vocab_size * hidden
    count += num_decoder_layers(geometry) * 3 * MLP_RATIO * hidden * hidden
    for layer in geometry.layers:
        count += 4 * hidden * sum(s.num_units * s.unit_elems for s in layer.spec.compute_segments())
    return count


class DecoderLayer:
    def __init__(self, index, mixer, hidden: int, tp: TPGroup, w: WeightSource):
        p = f"layers.{index}."
        self.mixer = mixer
        self.mixer_norm = w.place(w.normal(p + "mixer_norm", (hidden,), 0.1, mean=1.0))
        self.mlp_norm = w.place(w.normal(p + "mlp_norm", (hidden,), 0.1, mean=1.0))
        self.mlp = MLP(p + "mlp.", hidden, MLP_RATIO * hidden, tp.size, tp.rank, w)
        self.tp = tp

    def __call__(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        if self.mixer is not None:
            x = x + self.tp.all_reduce_(self.mixer(rms_norm(x, self.mixer_norm), step))
        return x + self.tp.all_reduce_(self.mlp(rms_norm(x, self.mlp_norm)))


class HybridModel:
    """TP rank `tp.rank` of the model for `geometry` (GDN, KDA, GQA and MLA layers)."""

    def __init__(
        self,
        geometry: ModelGeometry,
        tp: TPGroup,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        unsupported = sorted({lay.kind.value for lay in geometry.layers if lay.kind not in MIXERS})
        if unsupported:
            raise ValueError(f"model {geometry.name!r}: the engine has no {unsupported} layers")
        params = parameter_count(geometry)
        if params > MAX_PARAMS:
            raise ValueError(
                f"model {geometry.name!r}: ~{params / 1e6:.0f}M parameters; the engine builds "
                f"random tiny models only (<= {MAX_PARAMS / 1e6:.0f}M), use a tiny-* preset"
            )
        geometry.check_tp(tp.size)
        self.geometry = geometry
        self.tp = tp
        self.seed = seed
        self.device = torch.device(device)
        hidden, vocab = geometry.hidden_size, geometry.vocab_size
        w = WeightSource(seed, device)
        self.embed = w.place(w.normal("embed", (vocab, hidden), 1.0))
        by_index = {layer.index: layer for layer in geometry.layers}
        self.layers = []
        for i in range(num_decoder_layers(geometry)):
            spec = by_index.get(i)
            mixer = None
            if spec is not None:
                mixer = MIXERS[spec.kind](spec, hidden, tp.size, tp.rank, w)
            self.layers.append(DecoderLayer(i, mixer, hidden, tp, w))
        self.final_norm = w.place(w.normal("final_norm", (hidden,), 0.1, mean=1.0))
        self.lm_head = w.place(w.linear("lm_head", vocab, hidden, gain=LM_HEAD_GAIN))

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, step: Step, all_logits: bool = False):
        """token_ids [T] -> logits [vocab] of the last token ([T, vocab] if all_logits)."""
        x = self.embed[token_ids]
        for layer in self.layers:
            x = layer(x, step)
        if not all_logits:
            x = x[-1:]
        logits = rms_norm(x, self.final_norm) @ self.lm_head.T
        return logits if all_logits else logits[0]
