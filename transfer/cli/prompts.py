"""`launch --prompts FILE`: one request per JSONL line, as token ids or as text."""

from __future__ import annotations

import json
from pathlib import Path

from transfer.errors import InvalidInput, NotFound


def load_prompts(path: str | Path, vocab_size: int, encode=None) -> list[list[int]]:
    """Each line is {"prompt_token_ids": [...]} or {"prompt": "text"}; text needs `encode`
    (the checkpoint's tokenizer). Blank lines are skipped; errors name the line (from 1)."""
    path = Path(path)
    if not path.is_file():
        raise NotFound(f"prompts: {str(path)!r} is not a file")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"prompts: {path}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidInput(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(item, dict):
            raise InvalidInput(f"{where}: expected an object")
        if "prompt_token_ids" in item:
            ids = item["prompt_token_ids"]
            if (
                not isinstance(ids, list)
                or not ids
                or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
                    for t in ids
                )
            ):
                raise InvalidInput(
                    f"{where}: prompt_token_ids must be a non-empty list of ids in [0, {vocab_size})"
                )
        elif "prompt" in item:
            if not isinstance(item["prompt"], str) or not item["prompt"]:
                raise InvalidInput(f"{where}: prompt must be a non-empty string")
            if encode is None:
                raise InvalidInput(
                    f"{where}: a text prompt needs the checkpoint's tokenizer.json; "
                    "this model has none, so give prompt_token_ids"
                )
            ids = encode(item["prompt"])
            if not ids:
                raise InvalidInput(f"{where}: prompt encodes to no tokens")
        else:
            raise InvalidInput(f"{where}: needs 'prompt_token_ids' or 'prompt'")
        prompts.append(ids)
    if not prompts:
        raise InvalidInput(f"prompts: {path} holds no requests")
    return prompts
