"""Text for the HTTP front end: a checkpoint's tokenizer, its chat template, and streaming
detokenization with stop strings.

The chat template is rendered the way transformers renders it: a sandboxed jinja2
environment with trim_blocks/lstrip_blocks, `raise_exception`, a `tojson` that does not
escape HTML, and `messages`, `add_generation_prompt`, `bos_token`, `eos_token` in scope.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from transfer.errors import InvalidInput


def _raise(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


@dataclass
class TextCodec:
    """A checkpoint's tokenizer (tokenizer.json) and chat template (tokenizer_config.json)."""

    tokenizer: Tokenizer
    chat_template: jinja2.Template | None = None
    bos_token: str | None = None
    eos_token: str | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> TextCodec | None:
        """The codec of a checkpoint directory; None when it has no tokenizer.json."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            return None
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = config.get("chat_template")
        jinja_path = path / "chat_template.jinja"
        if template is None and jinja_path.is_file():
            template = jinja_path.read_text()
        return cls(
            tokenizer,
            compile_chat_template(template) if isinstance(template, str) else None,
            _token_text(config.get("bos_token")),
            _token_text(config.get("eos_token")),
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters one token spells (a vocabulary entry is at least as long
        as the text it stands for: byte-level entries are one character per byte)."""
        return max(map(len, self.tokenizer.get_vocab(with_added_tokens=True)), default=1)

    @cached_property
    def _specials(self) -> dict[str, int]:
        decoder = self.tokenizer.get_added_tokens_decoder()
        return {t.content: i for i, t in decoder.items() if t.special and t.content}

    @cached_property
    def _plain(self) -> Tokenizer:
        """A copy that spells special tokens' text as ordinary text (its own instance, as
        the flag is the tokenizer's, not the call's)."""
        plain = Tokenizer.from_str(self.tokenizer.to_str())
        plain.encode_special_tokens = True
        return plain

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The rendered chat's ids, with the template's special tokens special and the
        messages' own text plain: `<|im_end|>` typed by a user is text, not the end of a
        turn. Without special text in any content this is `encode(render_chat(...))`."""
        rendered = self.render_chat(messages)
        contents = [m.get("content") or "" for m in messages]
        if not any(s in c for c in contents for s in self._specials):
            return self.encode(rendered)
        spans, at = [], 0
        for i, content in enumerate(contents):
            found = rendered.find(content, at) if content else at
            if found < 0:
                if any(s in content for s in self._specials):
                    raise InvalidInput(
                        f"messages[{i}].content: holds a special token's text, and the chat "
                        "template changes the content, so it cannot be kept apart"
                    )
                continue
            spans.append((found, found + len(content)))
            at = found + len(content)
        return self._encode_outside(rendered, spans)

    def _encode_outside(self, text: str, spans: list[tuple[int, int]]) -> list[int]:
        """Split `text` at special tokens outside `spans` only, as the tokenizer splits at
        every special token, and encode the pieces between as plain text."""
        pattern = "|".join(map(re.escape, sorted(self._specials, key=len, reverse=True)))
        ids: list[int] = []
        piece = 0
        for match in re.finditer(pattern, text):
            if any(start <= match.start() < end for start, end in spans):
                continue
            if match.start() > piece:
                ids += self._plain.encode(text[piece : match.start()], add_special_tokens=False).ids
            ids.append(self._specials[match.group()])
            piece = match.end()
        if piece < len(text):
            ids += self._plain.encode(text[piece:], add_special_tokens=False).ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: list[dict]) -> str:
        if self.chat_template is None:
            raise InvalidInput("messages: this model has no chat template; use /v1/completions")
        try:
            return self.chat_template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as exc:
            raise InvalidInput(f"messages: the chat template refused them ({exc})") from None


class StreamingText:
    """Turns generated token ids into text deltas, holding back what could still become a
    stop string or an incomplete UTF-8 character, so no client ever sees either."""

    def __init__(self, codec: TextCodec, stop: Sequence[str] = ()) -> None:
        self.codec = codec
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already emitted
        self.stopped = False

    def push(self, token: int) -> str:
        """Add one token; return the text that is now safe to send."""
        self.ids.append(token)
        text = self.codec.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""  # a multi-byte character is not complete yet
        for stop in self.stop:
            at = text.find(stop, max(0, self.sent - len(stop) + 1))
            if at != -1:
                self.stopped = True
                delta = text[self.sent : at]
                self.sent = at
                return delta
        hold = max((_overlap(text, s) for s in self.stop), default=0)
        safe = len(text) - hold
        delta = text[self.sent : safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return delta

    def flush(self) -> str:
        """The held-back tail once generation ended without a stop string."""
        if self.stopped:
            return ""
        text = self.codec.decode(self.ids)
        delta = text[self.sent :]
        self.sent = len(text)
        return delta

    @property
    def text(self) -> str:
        return (
            self.codec.decode(self.ids)[: self.sent]
            if self.stopped
            else self.codec.decode(self.ids)
        )


def _overlap(text: str, stop: str) -> int:
    """The longest suffix of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
