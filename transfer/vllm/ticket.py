"""The ticket a prefill server returns in `kv_transfer_params` and decode passes back.

It is the payload of vLLM's two-step disaggregated protocol: the prefill response carries it,
the proxy copies it into the decode request unchanged. Only JSON types cross, so any proxy
(vLLM's toy proxy, llm-d, Dynamo) can forward it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transfer.errors import InvalidInput

PARAMS_KEY = "pdxfer"


@dataclass(frozen=True)
class Ticket:
    """Where a finished prefill's cache lives and how it is laid out.

    block_ids: per vLLM KV-cache group, the prefill side's block ids (attention groups hold
    one id per block of prompt tokens; mamba groups hold the state block).
    staged_offsets: per prefill TP rank, the stage slot (virtual offset) holding the partial
    last attention block's tokens (`transfer/vllm/stage_tail.py`); () when that block
    crosses whole.
    digest_offsets: per prefill TP rank, its digest table of this request (virtual offset,
    `transfer/vllm/digests.py`); () when prefill publishes none (verify off).
    """

    control_address: str
    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    tp_size: int
    compat_hash: str
    staged_offsets: tuple[int, ...] = ()
    digest_offsets: tuple[int, ...] = ()

    def to_params(self) -> dict[str, Any]:
        """The `kv_transfer_params` a prefill response carries."""
        return {
            PARAMS_KEY: {
                "control_address": self.control_address,
                "request_id": self.request_id,
                "block_ids": [list(group) for group in self.block_ids],
                "num_tokens": self.num_tokens,
                "tp_size": self.tp_size,
                "compat_hash": self.compat_hash,
                "staged_offsets": list(self.staged_offsets),
                "digest_offsets": list(self.digest_offsets),
            }
        }

    @classmethod
    def from_params(cls, params: Any) -> Ticket:
        """Parse a decode request's `kv_transfer_params`; InvalidInput names the bad field."""
        if not isinstance(params, dict) or not isinstance(params.get(PARAMS_KEY), dict):
            raise InvalidInput(f"kv_transfer_params.{PARAMS_KEY}: missing or not an object")
        body = params[PARAMS_KEY]
        for key in ("control_address", "request_id", "compat_hash"):
            if not isinstance(body.get(key), str) or not body[key]:
                raise InvalidInput(f"kv_transfer_params.{PARAMS_KEY}.{key}: not a non-empty string")
        for key, low in (("num_tokens", 1), ("tp_size", 1)):
            value = body.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise InvalidInput(
                    f"kv_transfer_params.{PARAMS_KEY}.{key}: not an integer >= {low}"
                )
        groups = body.get("block_ids")
        if not isinstance(groups, list) or not groups:
            raise InvalidInput(f"kv_transfer_params.{PARAMS_KEY}.block_ids: not a non-empty list")
        for i, group in enumerate(groups):
            if not isinstance(group, list) or not all(
                isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in group
            ):
                raise InvalidInput(
                    f"kv_transfer_params.{PARAMS_KEY}.block_ids[{i}]: not a list of block ids"
                )
        staged, digests = (_offsets(body, key) for key in ("staged_offsets", "digest_offsets"))
        return cls(
            control_address=body["control_address"],
            request_id=body["request_id"],
            block_ids=tuple(tuple(group) for group in groups),
            num_tokens=body["num_tokens"],
            tp_size=body["tp_size"],
            compat_hash=body["compat_hash"],
            staged_offsets=staged,
            digest_offsets=digests,
        )


def _offsets(body: dict[str, Any], key: str) -> tuple[int, ...]:
    """An optional list of one virtual offset per prefill rank."""
    offsets = body.get(key, [])
    if not isinstance(offsets, list) or not all(
        isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets
    ):
        raise InvalidInput(f"kv_transfer_params.{PARAMS_KEY}.{key}: not a list of offsets")
    if offsets and len(offsets) != body["tp_size"]:
        raise InvalidInput(
            f"kv_transfer_params.{PARAMS_KEY}.{key}: {len(offsets)} offsets for "
            f"tp_size {body['tp_size']}"
        )
    return tuple(offsets)
