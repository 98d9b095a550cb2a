"""The HTTP front end's `Engine` over vLLM OpenAI servers, in vLLM's two-step P/D protocol.

A request goes first to a prefill server with `kv_transfer_params: {"do_remote_decode": true}`
and `max_tokens` 1; the `kv_transfer_params` it answers with (the connector's ticket) go
unchanged with the same prompt to a decode server, whose connector pulls the cache and whose
token stream is passed on. llm-d's and Dynamo's proxies speak the same protocol, so any KV
connector that speaks it works behind this front end (PdxferConnector, NixlConnector).
"""

from __future__ import annotations

import enum
import itertools
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from transfer.errors import InvalidInput, PeerUnavailable
from transfer.serving.addresses import join_address, resolve
from transfer.serving.openai.schema import ApiError, Sampling

REQUEST_TIMEOUT_S = 600.0  # a decode stream may run long; a dead server fails at connect
HEALTH_TIMEOUT_S = 2.0


class Outcome(enum.Enum):
    OK = "ok"
    PREFILL_FAILED = "prefill_failed"
    DECODE_FAILED = "decode_failed"


@dataclass(frozen=True)
class VllmToken:
    """One token of a decode server's stream, as the HTTP app reads events."""

    token: int
    logprob: float | None
    finished: bool
    cached_prompt_tokens: int = 0


def parse_server_url(url: str, flag: str) -> tuple[str, int]:
    """`http://HOST:PORT` -> (host, port); InvalidInput naming `flag` otherwise."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None or parts.path not in ("", "/"):
        raise InvalidInput(f"{flag}: expected a vLLM server's URL http://HOST:PORT, got {url!r}")
    return parts.hostname, port


class _Pool:
    """The servers behind some URLs (a headless Service name resolves to each of its pods),
    taken in turn."""

    def __init__(self, urls: Sequence[str], flag: str) -> None:
        if not urls:
            raise InvalidInput(f"{flag}: name at least one vLLM server (http://HOST:PORT)")
        self.addresses = [join_address(*parse_server_url(url, flag)) for url in urls]
        self._turn = itertools.count()

    def servers(self) -> list[str]:
        """Every server's base URL now (DNS is asked again each time: pods come and go)."""
        return ["http://" + ip for address in self.addresses for ip in resolve(address)]

    def next(self) -> str:
        servers = self.servers()
        return servers[next(self._turn) % len(servers)]


class VllmMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "pdxfer_router_vllm_requests",
            "Requests through vLLM prefill and decode servers, by outcome",
            ["outcome"],
            registry=registry,
        )


def _post(url: str, body: dict[str, Any], timeout_s: float):
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    return urllib.request.urlopen(request, timeout=timeout_s)


def post_completion(
    base_url: str,
    prompt_ids: list[int],
    max_tokens: int,
    *,
    timeout_s: float = REQUEST_TIMEOUT_S,
    **extra: Any,
) -> dict:
    """One greedy, non-streamed /v1/completions on the vLLM server at `base_url`, token ids
    in and out (`choices[0].token_ids`); `extra` joins the body (e.g. cache_salt). A refusal
    raises ApiError with the server's status and message, an unreachable server
    PeerUnavailable."""
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True, **extra}  # fmt: skip
    try:
        with _post(base_url + "/v1/completions", body, timeout_s) as response:
            return json.loads(response.read())
    except OSError as exc:  # urllib's HTTPError and URLError among them
        raise _upstream_error(base_url, "vLLM", exc) from exc


def _upstream_error(server: str, phase: str, exc: Exception) -> Exception:
    """A vLLM server's refusal (its status and message) or an unreachable server (503)."""
    if isinstance(exc, urllib.error.HTTPError):
        try:
            document = json.loads(exc.read() or b"{}")
        except (json.JSONDecodeError, OSError):
            document = {}
        error = document.get("error", document) if isinstance(document, dict) else {}
        message = error.get("message") if isinstance(error, dict) else None
        status = exc.code if 400 <= exc.code < 600 else 502
        return ApiError(status, f"{phase} server {server}: {message or exc.reason}")
    return PeerUnavailable(f"{phase} server {server} is unreachable: {exc}")


class VllmEngine:
    """Generates through vLLM prefill and decode servers (see the module docstring)."""

    def __init__(
        self,
        prefill_urls: Sequence[str],
        decode_urls: Sequence[str],
        registry: CollectorRegistry,
        timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self.prefill = _Pool(prefill_urls, "--prefill")
        self.decode = _Pool(decode_urls, "--decode")
        self.metrics = VllmMetrics(registry)
        self.timeout_s = timeout_s

    def _body(self, prompt_ids: list[int], sampling: Sampling, max_tokens: int) -> dict:
        body = {
            # vLLM serves a model under any name it was given; the checkpoint path is one
            # whatever --served-model-name says, so name none (vLLM takes its first).
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "return_token_ids": True,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed % (1 << 63)
        if sampling.logprobs is not None:
            body["logprobs"] = 0  # the chosen token's logprob only
        return body

    def _prefill(self, request_id: str, prompt_ids: list[int], sampling: Sampling) -> dict:
        server = self.prefill.next()
        body = self._body(prompt_ids, sampling, 1)
        body["kv_transfer_params"] = {"do_remote_decode": True}
        body["request_id"] = request_id
        try:
            with _post(server + "/v1/completions", body, self.timeout_s) as response:
                return json.loads(response.read())
        except (urllib.error.URLError, OSError) as exc:
            raise _upstream_error(server, "prefill", exc) from exc

    def generate(
        self, request_id: str, prompt_ids: list[int], sampling: Sampling
    ) -> Iterator[VllmToken]:
        """Prefill remotely, then stream the decode server's tokens; closing the iterator
        closes the decode stream (vLLM then aborts the request)."""
        try:
            first = self._prefill(request_id, prompt_ids, sampling)
        except Exception:
            self.metrics.requests.labels(Outcome.PREFILL_FAILED.value).inc()
            raise
        params = first.get("kv_transfer_params")
        if not isinstance(params, dict):
            self.metrics.requests.labels(Outcome.PREFILL_FAILED.value).inc()
            raise ApiError(
                502,
                "the prefill server returned no kv_transfer_params: is it running with a KV "
                "connector (--kv-transfer-config)?",
            )
        details = (first.get("usage") or {}).get("prompt_tokens_details") or {}
        cached = int(details.get("cached_tokens") or 0)
        body = self._body(prompt_ids, sampling, sampling.max_tokens)
        body.update(stream=True, kv_transfer_params=params, request_id=request_id)
        server = self.decode.next()
        outcome = Outcome.DECODE_FAILED
        try:
            try:
                response = _post(server + "/v1/completions", body, self.timeout_s)
            except (urllib.error.URLError, OSError) as exc:
                raise _upstream_error(server, "decode", exc) from exc
            with response:
                for token in _stream_tokens(response, server, cached):
                    yield token
                    if token.finished:
                        break
            outcome = Outcome.OK
        except GeneratorExit:
            outcome = Outcome.OK  # the consumer stopped (stop string, EOS, client gone)
            raise
        finally:
            self.metrics.requests.labels(outcome.value).inc()

    def is_ready(self) -> bool:
        """Whether at least one prefill and one decode server answer /health."""
        return all(
            any(_healthy(url) for url in pool.servers()) for pool in (self.prefill, self.decode)
        )


def _healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=HEALTH_TIMEOUT_S) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _stream_tokens(response, server: str, cached: int) -> Iterator[VllmToken]:
    """The tokens of a vLLM completions SSE stream (one choice)."""
    first = True
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            error = chunk["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise ApiError(502, f"decode server {server}: {message}")
        for choice in chunk.get("choices", ()):
            ids = choice.get("token_ids") or []
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
            for i, token in enumerate(ids):
                last = i == len(ids) - 1 and choice.get("finish_reason") is not None
                logprob = logprobs[i] if i < len(logprobs) else None
                yield VllmToken(int(token), logprob, last, cached if first else 0)
                first = False
