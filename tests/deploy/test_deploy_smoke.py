"""The smoke Job's script, exactly as the kubelet would run it, against the router's
HTTP front end (build_app on uvicorn, over an in-process engine): it passes on a good
reply and fails on every bad one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from k8s_manifests import command_lines, container_env, is_shell, objects_of, rendered

from transfer.model.tiny_tokenizer import write_tiny_tokenizer
from transfer.serving.openai.app import build_app
from transfer.serving.openai.handler import ServedModel
from transfer.serving.openai.http_server import HttpServer
from transfer.serving.openai.text import TextCodec

API_KEY = "smoke-test-key"


@dataclass(frozen=True)
class Event:
    token: int
    logprob: float | None
    finished: bool


class CountingEngine:
    """Token i of a request is (sum(prompt) + i) % 100 + 3; `requests` records them."""

    def __init__(self, tokens: int | None = None, fail: Exception | None = None) -> None:
        self.tokens = tokens
        self.fail = fail
        self.requests: list[tuple[list[int], object]] = []

    def generate(self, request_id, prompt_ids, sampling):
        self.requests.append((list(prompt_ids), sampling))
        if self.fail is not None:
            raise self.fail
        count = sampling.max_tokens if self.tokens is None else self.tokens
        base = sum(prompt_ids)
        for i in range(count):
            yield Event((base + i) % 100 + 3, None, i == count - 1)

    def is_ready(self) -> bool:
        return True


@pytest.fixture(scope="module")
def codec(tmp_path_factory) -> TextCodec:
    path = tmp_path_factory.mktemp("tokenizer")
    write_tiny_tokenizer(path, 512)
    return TextCodec.from_dir(path)


@pytest.fixture(scope="module")
def script() -> tuple[str, dict[str, str]]:
    """The smoke container's script and environment, $(VAR) expanded as by the kubelet."""
    objects = rendered("smoke")
    (line,) = command_lines(objects)
    assert is_shell(line) and not line.missing, line.label
    return line.argv[2], container_env(line.container, line.pod, {}, objects)


@pytest.fixture(scope="module")
def served_name() -> str:
    """What the router serves by default: the checkpoint directory's name."""
    model = objects_of(rendered("base"), "ConfigMap")["pdxfer-config"]["data"]["MODEL"]
    return Path(model).name


def run_smoke(script, tmp_path: Path, app, key: str = API_KEY) -> subprocess.CompletedProcess:
    text, env = script
    if shutil.which("curl") is None:
        pytest.skip("curl not found")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    python3 = bin_dir / "python3"
    if not python3.exists():
        python3.symlink_to(sys.executable)
    key_file = tmp_path / "key"
    key_file.write_text(key + "\n")  # as `kubectl create secret --from-file` keeps it
    server = HttpServer(app, "127.0.0.1", 0)
    try:
        # Only the Service's address and the Secret's mount differ from the pod.
        env = {
            **env,
            "PDXFER_URL": f"http://127.0.0.1:{server.port}",
            "PDXFER_API_KEY_FILE": str(key_file),
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        }
        return subprocess.run(
            ["sh", "-c", text], env=env, capture_output=True, text=True, timeout=60
        )
    finally:
        server.stop()


def app_of(engine, codec, name: str):
    model = ServedModel(name, max_model_len=256, codec=codec)
    return build_app(engine, model, api_key=API_KEY)


def test_smoke_job_sends_a_valid_completion_and_passes(script, tmp_path, codec, served_name):
    engine = CountingEngine()
    done = run_smoke(script, tmp_path, app_of(engine, codec, served_name))
    assert done.returncode == 0, done.stderr
    assert "smoke: ok" in done.stdout and served_name in done.stdout
    ((prompt, sampling),) = engine.requests
    assert prompt == codec.encode("The capital of France is")
    assert sampling.max_tokens == 8 and sampling.temperature == 0


@pytest.mark.parametrize(
    "case",
    ["wrong key", "engine fails", "no tokens", "reply is not json"],
)
def test_smoke_job_fails_unless_the_reply_is_a_completion(
    case, script, tmp_path, codec, served_name
):
    engine, key, name = CountingEngine(), API_KEY, served_name
    if case == "wrong key":
        key = "not-the-key"
    elif case == "engine fails":
        engine = CountingEngine(fail=RuntimeError("decode instance gone"))
    elif case == "no tokens":
        engine = CountingEngine(tokens=0)
    app = app_of(engine, codec, name)
    if case == "reply is not json":
        # /v1/models answers; /v1/completions replies 200 with something else.
        from fastapi.responses import PlainTextResponse

        app.router.routes = [r for r in app.router.routes if r.path != "/v1/completions"]

        @app.post("/v1/completions")
        async def broken():
            return PlainTextResponse("<html>proxy error</html>")

    done = run_smoke(script, tmp_path, app, key=key)
    assert done.returncode != 0, (case, done.stdout)
    assert done.stderr.strip(), case  # says why
