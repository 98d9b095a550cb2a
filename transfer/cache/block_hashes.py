"""The chained hashes that key full KV blocks: hash i covers a prompt's blocks 0..i, so
equal hashes mean equal prefixes. The prefix cache, the decode side's held blocks and the
router's prefix-aware routing all key blocks by them."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from transfer.errors import InvalidInput

_INT64_MAX = np.iinfo(np.int64).max


def check_int(field: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidInput(f"{field} must be an integer >= {minimum}, got {value!r}")
    return value


def _is_token(t: object) -> bool:
    if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
        return False
    return 0 <= t <= _INT64_MAX


def _token_array(token_ids: Sequence[int]) -> np.ndarray:
    try:
        arr = np.asarray(token_ids)
    except (TypeError, ValueError):  # ragged
        arr = np.asarray([None])
    ok = arr.ndim == 1 and (
        not arr.size or arr.dtype.kind in "iu" and arr.min() >= 0 and arr.max() <= _INT64_MAX
    )
    if ok and not isinstance(token_ids, np.ndarray):  # numpy reads [True, 2] as integers
        ok = not any(isinstance(t, (bool, np.bool_)) for t in token_ids)
    if not ok:
        bad = next((t for t in token_ids if not _is_token(t)), token_ids)
        raise InvalidInput(f"token_ids: token {bad!r} is not an integer in [0, 2**63)")
    return arr.astype("<i8", copy=False)


def block_hashes(token_ids: Sequence[int], block_size: int, salt: bytes = b"") -> tuple[bytes, ...]:
    """Chained hash of every full block of `token_ids`: hash i covers blocks 0..i.

    hash_i = blake2b((hash_{i-1} or salt) + block i's tokens as little-endian int64), 16 bytes.
    A trailing partial block has no hash.
    """
    check_int("block_size", block_size, 1)
    if not isinstance(salt, bytes):
        raise InvalidInput(f"salt must be bytes, got {type(salt).__name__}")
    arr = _token_array(token_ids)
    hashes, prev = [], salt
    for start in range(0, len(arr) - block_size + 1, block_size):
        prev = hashlib.blake2b(prev + arr[start : start + block_size].tobytes(), digest_size=16)
        prev = prev.digest()
        hashes.append(prev)
    return tuple(hashes)
