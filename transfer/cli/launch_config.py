"""What one `pdxfer launch` run was asked to do, checked once, as the flags gave it."""

from __future__ import annotations

from dataclasses import dataclass

from transfer.errors import InvalidInput
from transfer.serving.progress import DEFAULT_STREAM_LAYERS

_AT_LEAST_ONE = (
    "prefill_tp",
    "decode_tp",
    "requests",
    "prompt_len",
    "max_tokens",
    "block_size",
    "stream_layers",
)


@dataclass(frozen=True)
class LaunchConfig:
    """One launch run. `model` is a tiny preset or a checkpoint directory; `prompts` a JSONL
    file of requests (None: `requests` random prompts of `prompt_len` tokens); `timeout`
    bounds startup and, separately, the requests (seconds)."""

    model: str
    ssm_dtype: str = "auto"
    prompts: str | None = None
    prefill_tp: int = 1
    decode_tp: int = 1
    transport: str = "nixl"
    requests: int = 4
    prompt_len: int = 64
    max_tokens: int = 16
    ignore_eos: bool = False
    verify: bool = False
    json: bool = False
    seed: int = 0
    gpu_mem: str = "64MiB"
    block_size: int = 16
    device: str = "cpu"
    timeout: float = 300.0
    keep_logs: bool = False
    staging_mib: int = 8
    prefix_cache: bool = True
    shared_prefix: int = 0
    checkpoint_interval: int = 0
    transfer_mode: str = "whole"
    stream_layers: int = DEFAULT_STREAM_LAYERS

    def __post_init__(self) -> None:
        for name in _AT_LEAST_ONE:
            if getattr(self, name) < 1:
                flag = name.replace("_", "-")
                raise InvalidInput(f"--{flag} must be >= 1, got {getattr(self, name)}")
        if self.timeout <= 0:
            raise InvalidInput(f"--timeout must be > 0, got {self.timeout}")
        if not 0 <= self.shared_prefix < self.prompt_len:
            raise InvalidInput(
                f"--shared-prefix must be in [0, --prompt-len {self.prompt_len}), "
                f"got {self.shared_prefix}"
            )
        if self.shared_prefix and self.prompts:
            raise InvalidInput("--shared-prefix shapes the random prompts; not with --prompts")
        if self.staging_mib < 0:
            raise InvalidInput(f"--staging-mib must be >= 0, got {self.staging_mib}")
