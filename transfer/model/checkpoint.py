"""A Hugging Face checkpoint directory on local disk, read one TP rank's slices at a time.

A directory holds `config.json` and `*.safetensors` (one file, or shards listed in
`model.safetensors.index.json`), and optionally `tokenizer.json`. Nothing is downloaded.
Each rank reads only its own rows or columns of a tensor (`safe_open(...).get_slice`), so a
rank never holds another rank's weights, not even briefly.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from transfer.errors import InvalidInput, NotFound
from transfer.geometry import Segment

INDEX_FILE = "model.safetensors.index.json"


def unit_slice(segment: Segment, tp: int, rank: int) -> slice:
    """The elements (not units) of `segment` that rank `rank` of `tp` holds."""
    units = segment.units_on_rank(tp, rank)
    return slice(units.start * segment.unit_elems, units.stop * segment.unit_elems)


def rank_pieces(segments: Sequence[Segment], tp: int, rank: int) -> list[slice]:
    """Where the rank's part of each segment lies along an axis that concatenates
    `segments` in order: one slice per segment, in global element positions."""
    pieces, start = [], 0
    for segment in segments:
        own = unit_slice(segment, tp, rank)
        pieces.append(slice(start + own.start, start + own.stop))
        start += segment.num_units * segment.unit_elems
    return pieces


class Checkpoint:
    """The tensors of one checkpoint directory, by name, with the config as a dict.

    `rename` maps a prefix of names on disk to the one the model uses (for example
    "model.language_model." of a multimodal Qwen3.5 checkpoint is seen as "model.").
    """

    def __init__(self, path: str | Path, *, rename: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise NotFound(f"model: {str(path)!r} does not exist (nothing is downloaded)")
        if not self.path.is_dir():
            raise InvalidInput(f"model: {str(path)!r} is not a checkpoint directory")
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise InvalidInput(f"model: {str(path)!r} has no config.json")
        try:
            self.config: dict = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise InvalidInput(f"model: {config_path} is not valid JSON ({exc})") from None
        self._files = self._weight_files()
        self._rename = dict(rename or {})
        self._names: dict[str, tuple[Path, str]] = {}
        for file in sorted(set(self._files.values())):
            with safe_open(file, framework="pt") as handle:
                for stored in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    self._names[self._canonical(stored)] = (file, stored)
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}

    def _weight_files(self) -> dict[str, Path]:
        index = self.path / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise InvalidInput(f"model: {index} has no weight_map")
            files = {name: self.path / file for name, file in weight_map.items()}
            missing = sorted({str(f.name) for f in files.values() if not f.is_file()})
            if missing:
                raise InvalidInput(f"model: {index} lists missing shards {missing[:3]}")
            return files
        found = sorted(self.path.glob("*.safetensors"))
        if not found:
            raise InvalidInput(f"model: {str(self.path)!r} has no *.safetensors weights")
        return {file.name: file for file in found}

    def _canonical(self, stored: str) -> str:
        for old, new in self._rename.items():
            if stored.startswith(old):
                return new + stored[len(old) :]
        return stored

    def has(self, name: str) -> bool:
        return name in self._names

    def _slice(self, name: str):
        try:
            file, stored = self._names[name]
        except KeyError:
            raise InvalidInput(f"model: {self.path} has no tensor {name!r}") from None
        handle = self._handles.get(file)
        if handle is None:
            handle = self._stack.enter_context(safe_open(file, framework="pt"))
            self._handles[file] = handle
        return handle.get_slice(stored)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor (for replicated weights: norms, embeddings, small vectors)."""
        return self._slice(name)[:]

    def read_dim(
        self, name: str, dim: int, segments: Sequence[Segment], tp: int, rank: int
    ) -> torch.Tensor:
        """The rank's part of tensor `name` along `dim`, which concatenates `segments`: the
        rank's pieces of each segment, concatenated in order (dim 0 for column-parallel, 1 for
        row-parallel weights and fused expert tensors [E, 2I, H])."""
        handle = self._slice(name)
        shape = handle.get_shape()
        expected = sum(s.num_units * s.unit_elems for s in segments)
        if len(shape) <= dim or shape[dim] != expected:
            raise InvalidInput(
                f"model: tensor {name!r} has shape {list(shape)}, expected {expected} along "
                f"dim {dim} ({', '.join(f'{s.num_units} {s.name}' for s in segments)})"
            )
        lead = (slice(None),) * dim
        parts = [handle[(*lead, piece)] for piece in rank_pieces(segments, tp, rank)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
