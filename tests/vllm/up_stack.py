"""`pdxfer up --engine vllm` as a child process for tests: the URLs it prints, and a Ctrl-C
(SIGINT) stop after which none of its processes may be left."""

from __future__ import annotations

import contextlib
import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support.up_process import up_process
from tests.vllm.servers import START_TIMEOUT_S
from transfer.serving.launch.vllm_servers import Connector

STOP_TIMEOUT_S = 90.0


@dataclass(frozen=True)
class UpStack:
    prefill: str  # base URLs
    decode: str
    router: str


@contextlib.contextmanager
def running_up(
    model: Path, connector: Connector, *, prefill_tp: int = 1, decode_tp: int = 1
) -> Iterator[UpStack]:
    """`pdxfer up --engine vllm` with `connector` (this interpreter's vLLM) until the block
    ends; AssertionError if it does not come up, exits non-zero or leaves a process."""
    args = ["up", "--engine", "vllm", "--connector", connector.value, "--model", str(model),
            "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp),
            "--timeout", str(START_TIMEOUT_S)]  # fmt: skip
    with up_process(
        args,
        startup_s=2 * START_TIMEOUT_S + 60,
        stop_signal=signal.SIGINT,
        stop_s=STOP_TIMEOUT_S,
        leftovers_s=30.0,
        tail_chars=4000,
    ) as running:
        text = running.stdout
        urls = dict(re.findall(r"^(prefill|decode)\s+vLLM (http://\S+)", text, re.M))
        router = re.search(r"OpenAI API at (http://\S+)/v1", text).group(1)
        yield UpStack(urls["prefill"], urls["decode"], router)
