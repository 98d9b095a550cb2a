"""What one `pdxfer launch` run was asked to do, checked once, as the flags gave it."""

from __future__ import annotations

from dataclasses import dataclass

from transfer.errors import InvalidInput
from transfer.serving.engine.serve_options import serve_default

_AT_LEAST_ONE = (
    "prefill_tp",
    "decode_tp",
    "requests",
    "prompt_len",
    "max_tokens",
    "block_size",
    "stream_layers",
    "staging_min_packed",
)


@dataclass(frozen=True)
class LaunchConfig:
    """One launch run. `model` is a tiny preset or a checkpoint directory; `prompts` a JSONL
    file of requests (None: `requests` random prompts of `prompt_len` tokens); `timeout`
    bounds startup and, separately, the requests (seconds)."""

    model: str
    ssm_dtype: str = serve_default("ssm_dtype")
    prompts: str | None = None
    prefill_tp: int = serve_default("tp")
    decode_tp: int = serve_default("tp")
    transport: str = serve_default("transport")
    requests: int = 4
    prompt_len: int = 64
    max_tokens: int = 16
    ignore_eos: bool = False
    verify: bool = False
    json: bool = False
    seed: int = serve_default("seed")
    gpu_mem: str = serve_default("gpu_mem")
    block_size: int = serve_default("block_size")
    device: str = serve_default("device")
    timeout: float = 300.0
    keep_logs: bool = False
    staging_mib: int = serve_default("staging_mib")
    staging_min_packed: int = serve_default("staging_min_packed")
    prefix_cache: bool = serve_default("prefix_cache")
    shared_prefix: int = 0
    checkpoint_interval: int = serve_default("checkpoint_interval")
    transfer_mode: str = serve_default("transfer_mode")
    stream_layers: int = serve_default("stream_layers")

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
