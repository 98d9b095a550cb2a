"""Local copies and reads over one rank's registered regions, addressed by virtual offsets
(the transport's `RegionMap`), through `kernels.pack`: plain torch on the CPU, the Triton
kernel on CUDA -- one code path for both.

The worker's staged scatter on decode (staging -> cache: `stage_small` pieces and the staged
tail) and its tail gather on prefill (cache -> stage slot) go through `copy`; `gather` packs
ranges back to back for the verify digests. One kernel call per (source region, destination
region) pair.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from transfer.dataplane.regions import RegionMap

Columns = tuple[np.ndarray, np.ndarray, np.ndarray]  # (src, dst, nbytes) int64


class RegionCopies:
    """`regions[i]` (uint8 [nbytes], contiguous) is `region_map.regions[i]`."""

    def __init__(self, regions: Sequence[torch.Tensor], region_map: RegionMap) -> None:
        self.regions = list(regions)
        self.region_map = region_map
        self._starts = np.fromiter((r.start for r in region_map.regions), dtype=np.int64)

    def _local(self, offsets: np.ndarray, nbytes: np.ndarray, field: str):
        index = self.region_map.indices(offsets, nbytes, field)
        return index, offsets - self._starts[index]

    def copy(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        """Copy `nbytes[i]` from `src[i]` to `dst[i]` now (done when this returns)."""
        from kernels import copy_ranges

        src, dst, nbytes = (np.asarray(c, dtype=np.int64) for c in (src, dst, nbytes))
        keep = nbytes > 0
        src, dst, nbytes = src[keep], dst[keep], nbytes[keep]
        if not len(nbytes):
            return
        s_index, s_local = self._local(src, nbytes, "copies.src")
        d_index, d_local = self._local(dst, nbytes, "copies.dst")
        pair = s_index * len(self.regions) + d_index
        for key in np.unique(pair).tolist():
            rows = pair == key
            si, di = divmod(key, len(self.regions))
            copy_ranges(
                self.regions[si],
                self.regions[di],
                torch.from_numpy(s_local[rows]),
                torch.from_numpy(d_local[rows]),
                torch.from_numpy(nbytes[rows]),
            )
        self._sync()

    def gather(self, offsets: np.ndarray, nbytes: np.ndarray) -> torch.Tensor:
        """The ranges back to back, in order: uint8 [sum(nbytes)] on the regions' device."""
        from kernels import copy_ranges

        offsets, nbytes = (np.asarray(c, dtype=np.int64) for c in (offsets, nbytes))
        device = self.regions[0].device if self.regions else torch.device("cpu")
        out = torch.empty(int(nbytes.sum()), dtype=torch.uint8, device=device)
        if not len(nbytes):
            return out
        index, local = self._local(offsets, nbytes, "gather.offsets")
        packed = np.cumsum(nbytes) - nbytes  # where each range goes in `out`
        for i in np.unique(index).tolist():
            rows = index == i
            copy_ranges(
                self.regions[i],
                out,
                torch.from_numpy(local[rows]),
                torch.from_numpy(packed[rows]),
                torch.from_numpy(nbytes[rows]),
            )
        self._sync()
        return out

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """The bytes `[offset, offset + nbytes)` (one region's) as a uint8 view."""
        index, local = self._local(np.asarray([offset]), np.asarray([nbytes]), "view.offset")
        at = int(local[0])
        return self.regions[int(index[0])][at : at + nbytes]

    def zero(self, offsets: np.ndarray, nbytes: np.ndarray) -> None:
        """Zero the ranges now."""
        offsets, nbytes = (np.asarray(c, dtype=np.int64) for c in (offsets, nbytes))
        index, local = self._local(offsets, nbytes, "zero.offsets")
        for i, at, n in zip(index.tolist(), local.tolist(), nbytes.tolist(), strict=True):
            self.regions[i][at : at + n].zero_()

    def _sync(self) -> None:
        # The transport reads (prefill's stage slots) and vLLM's next forward see the bytes.
        if self.regions and self.regions[0].is_cuda:
            torch.cuda.synchronize(self.regions[0].device)
