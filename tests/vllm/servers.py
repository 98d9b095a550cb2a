"""Real vLLM servers for tests: started on a free loopback port, healthy before the test sees
them, stopped with their whole process group after (the log's tail is printed on failure)."""

from __future__ import annotations

import contextlib
import json
import re
import sys
import tempfile
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from transfer.net import free_port
from transfer.serving.launch.vllm_servers import (
    Connector,
    VllmServer,
    VllmServerSpec,
    connector_config,
    connector_env,
    start_vllm_server,
)
from transfer.serving.launch.vllm_stack import VllmPdPlan, running_vllm_pd

# Start-up on two shared cores: model load, then vLLM's warm-up (TP 2 is slower still); two
# servers starting together under other jobs' load took over 300 s.
START_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 240.0


@contextlib.contextmanager
def running_vllm(
    model: Path,
    *,
    name: str = "vllm",
    tp: int = 1,
    kv_transfer_config: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    extra_args: tuple[str, ...] = (),
    wait: bool = True,
    start_timeout_s: float = START_TIMEOUT_S,
) -> Iterator[VllmServer]:
    """A vLLM server for `model` (this interpreter's vLLM), healthy unless `wait` is False
    (then call `wait_healthy`: servers started together load at the same time); stopped on
    exit, with the log's tail printed if the block raised."""
    spec = VllmServerSpec(
        model=model,
        port=free_port(),
        name=name,
        tp=tp,
        kv_transfer_config=kv_transfer_config,
        env=dict(env or {}),
        python=sys.executable,
        extra_args=extra_args,
    )
    log_dir = Path(tempfile.mkdtemp(prefix=f"vllm-{name}-"))
    server = start_vllm_server(spec, log_dir)
    try:
        if wait:
            server.wait_healthy(start_timeout_s)
        yield server
    except BaseException:
        print(
            f"--- vLLM {name} log ({server.log_path}) ---\n{server.log_tail(80)}", file=sys.stderr
        )
        raise
    finally:
        server.stop()


@contextlib.contextmanager
def running_connector_vllm(
    model: Path,
    connector: Connector,
    *,
    name: str,
    tp: int = 1,
    wait: bool = True,
    env: Mapping[str, str] | None = None,
) -> Iterator[VllmServer]:
    """A vLLM server with `connector` as its KV connector (kv_role kv_both: it can serve as
    prefill and as decode)."""
    with running_vllm(
        model,
        name=name,
        tp=tp,
        kv_transfer_config=connector_config(connector),
        env={**connector_env(connector), **(env or {})},
        wait=wait,
    ) as server:
        yield server


@contextlib.contextmanager
def running_pd_pair(
    model: Path, connector: Connector, *, prefill_tp: int = 1, decode_tp: int = 1
) -> Iterator[tuple[VllmServer, VllmServer]]:
    """A prefill and a decode vLLM server with `connector`, started together, each on its own
    share of the CPUs; their logs' tails are printed if the block raised."""
    plan = VllmPdPlan(model, connector, sys.executable, prefill_tp, decode_tp)
    log_dir = Path(tempfile.mkdtemp(prefix="vllm-pd-"))
    with running_vllm_pd(plan, log_dir, START_TIMEOUT_S) as pair:
        try:
            yield pair
        except BaseException:
            for server in pair:
                print(
                    f"--- vLLM {server.spec.name} log ---\n{server.log_tail(80)}", file=sys.stderr
                )
            raise


def post_json(url: str, body: Mapping[str, Any], timeout_s: float = REQUEST_TIMEOUT_S) -> dict:
    """POST `body` as JSON; the decoded JSON answer (urllib raises on a non-2xx status)."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def get_text(url: str, timeout_s: float = 30.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read().decode()


def metric_sum(text: str, name: str) -> float:
    """The sum of `name` over its labels in Prometheus text (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if re.match(rf"^{re.escape(name)}(\{{.*\}})? ", line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def assert_pd_equals_colocated(
    prefill: VllmServer, decode: VllmServer, prompts: list[list[int]], max_tokens: int
) -> None:
    """Each prompt's P/D answer through a pdxfer ticket equals decode's own colocated one."""
    for prompt in prompts:
        colocated = greedy_completion(decode, prompt, max_tokens)["choices"][0]["token_ids"]
        response, params = pd_completion(prefill, decode, prompt, max_tokens)
        assert "pdxfer" in params
        assert response["choices"][0]["token_ids"] == colocated, len(prompt)


def greedy_completion(
    server: VllmServer, prompt_ids: list[int], max_tokens: int, **extra: Any
) -> dict:
    """One greedy /v1/completions request on token ids; the whole response document."""
    body = {
        "model": str(server.spec.model),
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    return post_json(server.url + "/v1/completions", body)


def pd_completion(
    prefill: VllmServer, decode: VllmServer, prompt_ids: list[int], max_tokens: int
) -> tuple[dict, dict]:
    """vLLM's two-step P/D protocol by hand: prefill with `do_remote_decode` (one token), then
    decode with the `kv_transfer_params` prefill returned. Returns (decode's response, those
    params)."""
    first = greedy_completion(prefill, prompt_ids, 1, kv_transfer_params={"do_remote_decode": True})
    params = first.get("kv_transfer_params")
    assert params, f"prefill returned no kv_transfer_params: {first}"
    return greedy_completion(decode, prompt_ids, max_tokens, kv_transfer_params=params), params
