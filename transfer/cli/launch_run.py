"""What `pdxfer launch` does once the workers are up: send the requests concurrently
while showing progress, and check each one (--verify)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transfer.geometry import ModelGeometry


class FinishReason(str, Enum):
    """Why a request's tokens ended: an end token (kept as the last token, as transformers'
    `generate` returns it) or `--max-tokens`."""

    STOP = "stop"
    LENGTH = "length"


def cut_at_end(tokens: Sequence[int], end_tokens: Collection[int]) -> list[int]:
    """`tokens` up to and including the first end token (all of them when none is there)."""
    for index, token in enumerate(tokens):
        if token in end_tokens:
            return list(tokens[: index + 1])
    return list(tokens)


@dataclass
class Outcome:
    """What one request came back with (filled by its thread)."""

    request_id: str
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    ttft_ms: float = 0.0
    transfer_ms: float = 0.0
    exposed_transfer_ms: float = 0.0
    kv_bytes: int = 0
    state_bytes: int = 0
    descriptors: int = 0
    cached_prompt_tokens: int = 0
    reused_decode_tokens: int = 0
    wall_s: float = 0.0
    error: str = ""
    problems: list[str] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.LENGTH
    done: bool = False

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def ok(self) -> bool:
        return not self.error and not self.problems


class Progress:
    """Progress on stderr: one rewritten line on a terminal, changes only otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last = ""

    def line(self, text: str) -> None:
        if self.tty and self.last:
            sys.stderr.write("\n")
        print(f"launch: {text}", file=sys.stderr, flush=True)
        self.last = ""

    def status(self, text: str) -> None:
        if text == self.last:
            return
        self.last = text
        if self.tty:
            sys.stderr.write(f"\rlaunch: {text}\033[K")
            sys.stderr.flush()
        else:
            print(f"launch: {text}", file=sys.stderr, flush=True)


def send_all(
    address: str,
    token: str,
    prompts: list[list[int]],
    max_tokens: int,
    timeout_s: float,
    say: Progress,
    start_index: int = 0,
    end_tokens: Collection[int] = (),
) -> list[Outcome]:
    """Send every prompt through the router at once; each outcome is filled by its own
    thread. A request stops at the first of `end_tokens` it generates (closing its stream
    cancels it on both sides). Requests still unanswered after `timeout_s` are marked as
    failed."""
    from transfer.control.client import EXIT_CLOSE_WAIT_S, RouterClient
    from transfer.control.types import GenerateRequest

    outcomes = [Outcome(f"req-{i:04d}", p) for i, p in enumerate(prompts, start_index)]
    if not outcomes:
        return []
    client = RouterClient(address, token=token)

    def one(out: Outcome) -> None:
        start = time.perf_counter()
        try:
            request = GenerateRequest(out.request_id, tuple(out.prompt), max_tokens)
            with contextlib.closing(client.generate(request)) as events:
                for event in events:
                    if event.index == 0:
                        out.ttft_ms, out.transfer_ms = event.ttft_ms, event.transfer_ms
                        out.exposed_transfer_ms = event.exposed_transfer_ms
                        out.kv_bytes, out.state_bytes = event.kv_bytes, event.state_bytes
                        out.descriptors = event.descriptors
                        out.cached_prompt_tokens = event.cached_prompt_tokens
                        out.reused_decode_tokens = event.reused_decode_tokens
                    out.tokens.append(event.token)
                    if event.token in end_tokens:
                        out.finish_reason = FinishReason.STOP
                        break
        except Exception as exc:  # a failed request is a row in the table, not a crash
            out.error = str(exc) or type(exc).__name__
        finally:
            out.wall_s = time.perf_counter() - start
            out.done = True

    threads = [threading.Thread(target=one, args=(o,), daemon=True) for o in outcomes]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    try:
        while not all(o.done for o in outcomes):
            if time.monotonic() > deadline:
                for o in outcomes:
                    if not o.done:
                        o.error = f"no answer within --timeout {timeout_s:g}s"
                break
            done = sum(o.done for o in outcomes)
            failed = sum(bool(o.error) for o in outcomes)
            tokens = sum(len(o.tokens) for o in outcomes)
            say.status(f"{done}/{len(outcomes)} done, {failed} failed, {tokens} tokens streamed")
            time.sleep(0.1)
    finally:
        client.close(EXIT_CLOSE_WAIT_S)  # cancels whatever is still streaming
        for t in threads:
            t.join(timeout=5.0)
    say.status(
        f"{len(outcomes)}/{len(outcomes)} done, {sum(bool(o.error) for o in outcomes)} failed"
    )
    return outcomes


class References:
    """The colocated TP=1 tokens of every prompt, computed on a thread while the workers
    start and serve (check 2 of --verify)."""

    def __init__(
        self,
        model: str,
        prompts: list[list[int]],
        max_tokens: int,
        seed: int,
        ssm_dtype: str = "auto",
    ) -> None:
        self.tokens: list[list[int]] = []
        self.error: BaseException | None = None
        self._args = (model, prompts, max_tokens, seed, ssm_dtype)
        self._thread = threading.Thread(target=self._run, name="pdxfer-reference", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            import torch

            from transfer.model.reference import reference_generate
            from transfer.presets import load_geometry
            from transfer.sizing import CacheDtypes

            if "OMP_NUM_THREADS" not in os.environ:
                torch.set_num_threads(1)  # a tiny model; more threads only fight the workers
            model, prompts, max_tokens, seed, ssm_dtype = self._args
            geometry = load_geometry(model)
            dtypes = CacheDtypes.for_model(geometry, ssm_dtype)
            self.tokens = [
                reference_generate(geometry, p, max_tokens, seed, source=model, dtypes=dtypes)
                for p in prompts
            ]
        except BaseException as exc:
            self.error = exc

    def get(self, timeout_s: float) -> list[list[int]]:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"the TP=1 reference run took over {timeout_s:g}s")
        if self.error is not None:
            raise RuntimeError(f"the TP=1 reference run failed: {self.error}") from self.error
        return self.tokens


def verify_outcomes(
    geometry: ModelGeometry,
    outcomes: list[Outcome],
    references: list[list[int]],
    dump_dir: Path,
    prefill_tp: int,
    decode_tp: int,
) -> None:
    """Add to each answered outcome the problems --verify finds: its caches against the
    re-sliced prefill caches (dumped under `dump_dir`), its tokens against `references`."""
    from transfer.serving.launch.verify import check_request, tokens_check

    for out, expected in zip(outcomes, references, strict=True):
        if out.error:
            continue
        check = check_request(geometry, dump_dir, out.request_id, prefill_tp, decode_tp)
        out.problems += check.problems
        problem = tokens_check(expected, out.tokens)
        if problem:
            out.problems.append(problem)
