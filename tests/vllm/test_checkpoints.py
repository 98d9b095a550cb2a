"""The tiny checkpoints are ones vLLM's CPU build accepts: its config parser reads them and its
registry resolves their architecture (no server: the server tests start real ones)."""

import pytest
from vllm.model_executor.models import ModelRegistry
from vllm.transformers_utils.config import get_config

from tests.vllm.checkpoints import VLLM_TINY_CONFIGS


@pytest.mark.parametrize("name", sorted(VLLM_TINY_CONFIGS))
def test_vllm_reads_the_tiny_checkpoint(vllm_checkpoint, name):
    directory = vllm_checkpoint(name)
    config = get_config(str(directory), trust_remote_code=False)
    written = VLLM_TINY_CONFIGS[name]
    # vLLM's CPU attention takes head dims of 128 only.
    for key in ("head_dim", "qk_nope_head_dim", "v_head_dim"):
        if key in written:
            assert getattr(config.get_text_config(), key) == written[key] == 128
    assert config.architectures[0] in ModelRegistry.get_supported_archs()
    assert (directory / "tokenizer.json").is_file()
    assert str(config.dtype).endswith("bfloat16")
