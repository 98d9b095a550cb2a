"""Read-side staging: many small ranges whose sources lie close together cross as one read.

When the destination scatters what the source keeps together (vLLM's default conv-state
layout, time-major, read across TP sizes: every step row splits into per-head pieces), each
piece would be a descriptor of its own. Here small ranges are grouped by source offset; a
group whose neighbours are at most `max_gap` bytes apart is read as one span into the
reader's staging area, gaps included, and then copied piece by piece into place locally.
Only the gaps cost extra bytes; only groups of two or more ranges are staged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SMALL_BYTES = 64 * 1024  # ranges below this may be staged (docs/architecture.md, "Design")
MAX_GAP_BYTES = 4096  # bytes a span may read that nobody needs, between two pieces
STAGING_ALIGN = 64


@dataclass(frozen=True, eq=False)
class StagedReads:
    """Reads of one source after staging. `wire`: (local, remote, nbytes) to post, with
    staged spans at `staging offset + base`; `copies`: (staging offset, local, nbytes) to run
    once the reads landed; offsets into staging are relative to the caller's `base`."""

    wire: tuple[np.ndarray, np.ndarray, np.ndarray]
    copies: tuple[np.ndarray, np.ndarray, np.ndarray]
    staging_bytes: int
    staged_ranges: int


def _empty() -> np.ndarray:
    return np.empty(0, dtype=np.int64)


def stage_small(
    local: np.ndarray,
    remote: np.ndarray,
    nbytes: np.ndarray,
    base: int,
    small_bytes: int = SMALL_BYTES,
    max_gap: int = MAX_GAP_BYTES,
) -> StagedReads:
    """Group the small ranges of one source by remote offset into spans read into staging
    at `base` onwards (wire local offsets are `base + ...`; copy sources likewise)."""
    local, remote, nbytes = (np.asarray(a, dtype=np.int64) for a in (local, remote, nbytes))
    small = np.flatnonzero(nbytes < small_bytes)
    small = small[np.argsort(remote[small], kind="stable")]
    spans: list[list[int]] = []  # member indices
    end = None
    for i in small.tolist():
        if (
            spans
            and end is not None
            and remote[i] >= remote[spans[-1][0]]
            and remote[i] - end <= max_gap
        ):
            spans[-1].append(i)
            end = max(end, int(remote[i] + nbytes[i]))
        else:
            spans.append([i])
            end = int(remote[i] + nbytes[i])
    direct = np.ones(len(nbytes), dtype=bool)
    wire_l, wire_r, wire_n = [], [], []
    copy_s, copy_d, copy_n = [], [], []
    cursor = 0
    staged = 0
    for members in spans:
        if len(members) < 2:
            continue
        idx = np.array(members, dtype=np.int64)
        start = int(remote[idx].min())
        stop = int((remote[idx] + nbytes[idx]).max())
        direct[idx] = False
        wire_l.append(base + cursor)
        wire_r.append(start)
        wire_n.append(stop - start)
        copy_s.append(base + cursor + remote[idx] - start)
        copy_d.append(local[idx])
        copy_n.append(nbytes[idx])
        cursor += -(-(stop - start) // STAGING_ALIGN) * STAGING_ALIGN
        staged += len(members)
    wire = (
        np.concatenate([local[direct], np.array(wire_l, dtype=np.int64)]),
        np.concatenate([remote[direct], np.array(wire_r, dtype=np.int64)]),
        np.concatenate([nbytes[direct], np.array(wire_n, dtype=np.int64)]),
    )
    copies = (
        tuple(np.concatenate(c) for c in (copy_s, copy_d, copy_n))
        if copy_s
        else (_empty(), _empty(), _empty())
    )
    return StagedReads(wire, copies, cursor, staged)
