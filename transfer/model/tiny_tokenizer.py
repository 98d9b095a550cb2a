"""A small byte-level BPE tokenizer and ChatML template for tiny checkpoints, so a demo can
speak text with no download. Trained in a fraction of a second on a built-in corpus."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from transfer.errors import InvalidInput

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)

# ChatML, the format Qwen's chat models use.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = (
    "Prefill computes the prompt and decode generates one token at a time. "
    "The cache of a request moves from the prefill worker to the decode worker. "
    "Hybrid models keep paged key value blocks and a fixed recurrent state per request. "
    "The quick brown fox jumps over the lazy dog. Hello, world! What is the capital of "
    "France? Paris is the capital of France. One, two, three, four, five, six, seven. "
    "user assistant system question answer tokens model serve transfer state layer."
)


def build_tiny_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE with exactly `vocab_size` ids at most (>= 259: bytes + specials)."""
    if vocab_size < MIN_VOCAB:
        raise InvalidInput(
            f"vocab_size: a byte-level tokenizer needs >= {MIN_VOCAB}, got {vocab_size}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tokenizer


def write_tiny_tokenizer(path: str | Path, vocab_size: int) -> tuple[int, ...]:
    """Write tokenizer.json and tokenizer_config.json (with the chat template) into `path`;
    returns the ids of the end tokens (<|endoftext|>, <|im_end|>)."""
    path = Path(path)
    tokenizer = build_tiny_tokenizer(vocab_size)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 1 << 20,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tuple(tokenizer.token_to_id(t) for t in (END_OF_TEXT, IM_END))
