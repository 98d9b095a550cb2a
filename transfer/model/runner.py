"""One TP rank's engine: prefill a prompt into a slot and blocks, decode from them.

Every rank of a TP group must make the same calls in the same order (they meet in
all-reduces); every rank returns the same tokens (rank 0's argmax is broadcast).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from transfer.geometry import ModelGeometry, Role
from transfer.model.caches import CacheAccess
from transfer.model.distributed import TPGroup
from transfer.model.layers.common import Step
from transfer.model.loader import RankModel, model_for_geometry
from transfer.model.sampling import GREEDY, Pick, Sampler, choose, logprob_of
from transfer.model.slots import SlotPhase, SlotTable


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens of KV."""
    return -(-num_tokens // block_size)


def is_index(value) -> bool:
    """An int-like (int, numpy or 0-d torch integer), not a bool or float."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


class RankEngine:
    """The model shard of rank `tp.rank` over that rank's `caches`.

    Lifecycle of a slot (FREE -> READY -> FREE): `prefill` (local, from a zero state) or
    `mark_filling` -> transfer -> `mark_ready` take a FREE slot to READY; `decode` and
    `decode_step` continue a READY slot exactly as its bytes are; `release` frees it.
    Any step or `mark_filling` that touches a slot or block being filled raises
    `CacheFillingError` (a RuntimeError) and changes nothing; decoding a FREE slot, or
    prefilling / filling a READY one, raises ValueError. `tp` None means TP=1 in-process;
    `device` is where the weights live and must be the caches' device. `model` is a shard
    built for the same geometry, rank and device (`transfer.model.loader.load_model`; it
    holds weights only, so engines may share it); without it the preset geometry's model is
    built from `seed`.
    """

    def __init__(
        self,
        geometry: ModelGeometry,
        caches: CacheAccess,
        tp: TPGroup | None = None,
        seed: int = 0,
        device: torch.device | str = "cpu",
        *,
        model: RankModel | None = None,
    ) -> None:
        self.geometry = geometry
        self.caches = caches
        self.tp = tp or TPGroup.single()
        self.device = torch.device(device)
        if model is None:
            model = model_for_geometry(geometry, self.tp, seed, self.device)
        elif (model.geometry, model.tp.size, model.tp.rank, model.device) != (
            geometry, self.tp.size, self.tp.rank, self.device
        ) or model.seed not in (None, seed):  # fmt: skip
            raise ValueError("model: built for another geometry, TP rank, seed or device")
        self.model = model
        self.slots = SlotTable(caches.num_slots)
        self.has_kv = bool(geometry.attention_layers)

    # -- transfer hooks (docs/bugs.md, bugs 4 and 6) -------------------------------------

    def mark_filling(self, slot: int, block_ids: Sequence[int]) -> None:
        """A transfer is about to write `slot` and `block_ids`; steps on them raise until ready."""
        self._check_blocks(block_ids, "block_ids")
        self.slots.mark_filling(slot, block_ids)

    def mark_ready(self, slot: int) -> None:
        """The transfer into `slot` completed; its bytes are the request's state, untouched."""
        self.slots.mark_ready(slot)

    def release(self, slot: int) -> None:
        """Forget the request in `slot` (finished, aborted, or its transfer failed)."""
        self.slots.release(slot)

    def slot_phase(self, slot: int) -> SlotPhase:
        return self.slots.phase(slot)

    def copy_state(self, src: int, dst: int) -> None:
        """Copy the S&Conv of every linear layer from slot `src` (READY) to slot `dst` (not
        being filled), which becomes READY: a prefix-cache checkpoint saved from a request's
        slot, or restored into one. The copies are the bytes exactly."""
        if self.slots.phase(src) is not SlotPhase.READY:
            raise ValueError(
                f"copy_state: slot {src} holds no state ({self.slots.phase(src).value})"
            )
        self.slots.check_not_filling(dst)
        with torch.inference_mode():  # the cache views are built under the model's
            for layer in self.geometry.linear_layers:
                for tensor in layer.cache_tensors():
                    if tensor.role is Role.SSM:
                        view = self.caches.ssm(layer.index)
                    else:
                        view = self.caches.conv(layer.index, tensor.name)
                    view[dst].copy_(view[src])
        self.slots.phases[dst] = SlotPhase.READY

    def copy_kv_rows(self, src: int, block_ids: Sequence[int], num_tokens: int) -> None:
        """Copy on write of a prefix hit that ends inside a block: the first
        `num_tokens % block_size` KV rows of block `src` (a cached block) go into the
        request's block holding token `num_tokens`, `block_ids[num_tokens // block_size]`,
        in every attention layer. The copies are the bytes exactly."""
        size = self.caches.block_size
        index, rows = divmod(num_tokens, size)
        if not rows or index >= len(block_ids):
            raise ValueError(
                f"copy_kv_rows: {num_tokens} tokens end on a block boundary or past "
                f"{len(block_ids)} blocks of {size}"
            )
        dst = block_ids[index]
        self._check_blocks([src, dst], "copy_kv_rows blocks")
        with torch.inference_mode():
            for layer in self.geometry.attention_layers:
                for tensor in layer.cache_tensors():
                    view = self.caches.kv(layer.index, tensor.name)
                    view[dst, :rows].copy_(view[src, :rows])

    # -- steps ----------------------------------------------------------------------------

    def prefill(self, prompt_ids: Sequence[int], block_ids: Sequence[int], slot: int) -> int:
        """Run the prompt from a zero state; write its KV into `block_ids` and the final
        S&Conv into `slot`; return the greedy first token (the same on every rank)."""
        return self._greedy(self.prefill_logits(prompt_ids, block_ids, slot))

    def prefill_logits(
        self, prompt_ids: Sequence[int], block_ids: Sequence[int], slot: int
    ) -> torch.Tensor:
        """As `prefill`, returning the last prompt token's logits [vocab] (fp32)."""
        if len(prompt_ids) == 0:
            raise ValueError("prompt_ids must not be empty")
        self._check_tokens(prompt_ids, "prompt_ids")
        self._check_request(block_ids, slot, len(prompt_ids))
        self.slots.begin_prefill(slot, block_ids)
        positions = torch.arange(len(prompt_ids), device=self.device)
        return self._forward(True, prompt_ids, positions, block_ids, slot)

    def decode_step_logits(
        self, token: int, position: int, block_ids: Sequence[int], slot: int
    ) -> torch.Tensor:
        """Feed `token` at `position` (the number of tokens already cached), appending its KV
        and advancing the slot's S&Conv; returns the next token's logits [vocab] (fp32)."""
        self._check_tokens([token], "token")
        if not isinstance(position, int) or position < 1:
            raise ValueError(
                f"position must be an int >= 1 (tokens already cached), got {position!r}"
            )
        self._check_request(block_ids, slot, position + 1)
        self.slots.check_decode(slot, block_ids)
        positions = torch.tensor([position], device=self.device)
        return self._forward(False, [token], positions, block_ids, slot)

    def decode_step(self, token: int, position: int, block_ids: Sequence[int], slot: int) -> int:
        """As `decode_step_logits`, returning the greedy next token."""
        return self._greedy(self.decode_step_logits(token, position, block_ids, slot))

    def prefill_pick(
        self,
        prompt_ids: Sequence[int],
        block_ids: Sequence[int],
        slot: int,
        sampler: Sampler = GREEDY,
    ) -> Pick:
        """As `prefill`, picking token 0 of the stream with `sampler`, with its logprob."""
        return self._pick(self.prefill_logits(prompt_ids, block_ids, slot), sampler, 0)

    def decode_step_pick(
        self,
        token: int,
        position: int,
        block_ids: Sequence[int],
        slot: int,
        sampler: Sampler = GREEDY,
        index: int = 0,
    ) -> Pick:
        """As `decode_step`, picking token `index` of the request's stream (0 is the one
        prefill picked) with `sampler`, with its logprob."""
        logits = self.decode_step_logits(token, position, block_ids, slot)
        return self._pick(logits, sampler, index)

    def decode(
        self,
        first_token: int,
        num_prompt_tokens: int,
        block_ids: Sequence[int],
        slot: int,
        max_new_tokens: int,
    ) -> list[int]:
        """The `max_new_tokens` greedy tokens that follow `first_token`.

        The slot holds the state after `num_prompt_tokens` prompt tokens (prefilled here or
        transferred in); `block_ids` must hold num_prompt_tokens + max_new_tokens tokens.
        The full generation is [first_token] + the result.
        """
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        self._check_request(block_ids, slot, num_prompt_tokens + max_new_tokens)
        tokens, token = [], first_token
        for i in range(max_new_tokens):
            token = self.decode_step(token, num_prompt_tokens + i, block_ids, slot)
            tokens.append(token)
        return tokens

    # -- internals ------------------------------------------------------------------------

    def _forward(self, prefill, token_ids, positions, block_ids, slot) -> torch.Tensor:
        ids = torch.tensor([int(t) for t in token_ids], dtype=torch.long, device=self.device)
        blocks = torch.tensor([int(b) for b in block_ids], dtype=torch.long, device=self.device)
        step = Step(prefill, positions, blocks, slot, self.caches)
        return self.model.forward(ids, step)

    def _greedy(self, logits: torch.Tensor) -> int:
        token = logits.argmax().reshape(1)
        return int(self.tp.broadcast_(token, src=0).item())

    def _pick(self, logits: torch.Tensor, sampler: Sampler, index: int) -> Pick:
        """Rank 0's choice and its logprob, the same on every rank. A greedy token is the
        argmax `_greedy` takes, bit for bit."""
        token = choose(logits, sampler, index)
        pair = torch.tensor([token, logprob_of(logits, token)], dtype=torch.float64)
        pair = self.tp.broadcast_(pair.to(self.device), src=0).cpu()
        return Pick(int(pair[0].item()), float(pair[1].item()))

    def _check_tokens(self, token_ids: Sequence[int], field: str) -> None:
        vocab = self.geometry.vocab_size
        bad = [t for t in token_ids if not is_index(t) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{field}: token ids must be ints in [0, {vocab}), got {bad[:5]}")

    def _check_blocks(self, block_ids: Sequence[int], field: str) -> None:
        n = self.caches.num_blocks
        bad = [b for b in block_ids if not is_index(b) or not 0 <= b < n]
        if bad:
            raise ValueError(f"{field}: block ids must be ints in [0, {n}), got {bad[:5]}")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"{field}: block ids must be distinct, got {list(block_ids)}")

    def _check_request(self, block_ids: Sequence[int], slot: int, num_tokens: int) -> None:
        self.slots.check_slot(slot)
        self._check_blocks(block_ids, "block_ids")
        need = blocks_needed(num_tokens, self.caches.block_size) if self.has_kv else 0
        if len(block_ids) < need:
            raise ValueError(
                f"block_ids: {num_tokens} tokens need {need} blocks of "
                f"{self.caches.block_size}, got {len(block_ids)}"
            )
