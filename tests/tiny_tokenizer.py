"""A byte-level BPE tokenizer small enough for the tiny random checkpoints (vocab 384), so that
a tiny checkpoint can be served over HTTP and loaded by transformers' ``AutoTokenizer`` (what
lm-evaluation-harness uses) with the same ids as the server's tokenizer."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

#: fixed training text: the merges (and so the ids) are the same on every run
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. The capital of France is Paris. "
    "Question: what is two plus two? Answer: four. A cat sat on the mat and the dog ran. "
    "Once upon a time there was a small model that could only count to ten. "
    "Hello world! It is a test of the tokenizer, with numbers 1 2 3 4 5 6 7 8 9 10. "
) * 4

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_tokenizer(path: str | Path, vocab_size: int = 384) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (eos ``<|endoftext|>``, a ChatML
    template) into ``path``: specials 0-2, the 256 byte tokens, then merges up to
    ``vocab_size`` ids."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    assert tok.get_vocab_size() <= vocab_size
    path = Path(path)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 512,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def servable_copy(checkpoint: str | Path, dest: str | Path) -> str:
    """A directory serving ``checkpoint``'s weights (symlinked) with the tiny tokenizer."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in os.listdir(checkpoint):
        if not (dest / name).exists():
            (dest / name).symlink_to(Path(checkpoint, name).resolve())
    write_tiny_tokenizer(dest)
    return str(dest)
