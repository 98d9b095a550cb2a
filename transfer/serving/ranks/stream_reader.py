"""A decode rank's side of layer-wise streaming: keep one READ of a request's progress
entries (one per prefill rank, `transfer.serving.ranks.progress`) in flight, and hand on the words
of the latest that landed. Posting and polling never wait, so a stream never stalls the
decode steps that run between polls."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from transfer.dataplane import Op, RangeBatch
from transfer.serving.ranks.progress import ENTRY_BYTES, WORDS


class ProgressReader:
    """READs `remote[r]` (the entry's offset on prefill rank r, peer `peers[r]`) into
    `local[r]` of `buffer` (this rank's arena) again and again."""

    def __init__(
        self,
        transport,
        peers: Sequence[str],
        remote: Sequence[int],
        local: Sequence[int],
        buffer: torch.Tensor,
        deadline_s: float,
    ) -> None:
        self.transport = transport
        self.sources = list(zip(peers, remote, local, strict=True))
        self.buffer = buffer
        self.deadline_s = deadline_s
        self.handles: list[int] = []
        self.words: tuple[int, ...] = (0,) * (WORDS * len(self.sources))
        self.failure = ""

    def advance(self) -> None:
        """Take the words of a landed round and post the next; note a failed READ."""
        if self.failure:
            return
        if self.handles:
            statuses = [self.transport.poll(h) for h in self.handles]
            failed = [s.reason for s in statuses if s.failed]
            if failed:
                self.failure = "progress: " + "; ".join(failed)
                return
            if any(s.pending for s in statuses):
                return
            self._release(self.handles)
            self.handles = []
            self.words = tuple(
                int(w)
                for _, _, local in self.sources
                for w in self.buffer[local : local + ENTRY_BYTES].view(torch.int64)[:WORDS]
            )
        for peer, remote, local in self.sources:
            batch = RangeBatch.single(local, remote, ENTRY_BYTES)
            self.handles.append(
                self.transport.post(Op.READ, peer, batch, deadline_s=self.deadline_s)
            )

    def stop(self) -> list[int]:
        """Stop reading; the handles of a round still in flight, for the caller to settle."""
        handles, self.handles = self.handles, []
        return handles

    def _release(self, handles: list[int]) -> None:
        for handle in handles:
            with contextlib.suppress(ValueError):
                self.transport.release(handle)
