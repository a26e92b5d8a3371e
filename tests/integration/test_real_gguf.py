"""The real Qwen2.5-Coder-0.5B-Instruct GGUF (Q4_K_M) served directly, without conversion.

``make real-checkpoint`` downloads and joins it (see docs/real_checkpoint.md); the test looks
for it where the build script writes it (``.cache/real_checkpoint/gguf/...`` of the repo root,
or ``QWEN_SERVE_REAL_GGUF``). The engine reads the file itself (``--model file.gguf``), in float32
on the CPU, and its greedy ids must equal transformers reading the same GGUF in float32, for 3
chat prompts of 48 new tokens each. Both dequantize with gguf-py; the tokenizer, chat template
and EOS ids the engine builds from the metadata are checked through the prompt ids.
"""

from __future__ import annotations

import pytest

from engine.core.config import EngineConfig
from engine.core.request import SamplingParams
from engine.frontend.tokenizer import Tokenizer
from engine.loader.gguf_loader import prepare_gguf_model_dir
from engine.worker.build import build_engine
from tests.integration.real_checkpoint_reference import (
    CHAT_PROMPTS,
    REAL_GGUF_PATH,
    gguf_chat_prompt_ids,
    real_gguf_available,
    transformers_gguf_greedy_ids,
)

pytestmark = [
    pytest.mark.real_checkpoint,
    pytest.mark.skipif(
        not real_gguf_available(),
        reason=f"no GGUF at {REAL_GGUF_PATH}: run `make real-checkpoint` first "
        "(or set QWEN_SERVE_REAL_GGUF)",
    ),
]

MAX_NEW = 48


def test_gguf_served_directly_greedy_ids_equal_transformers_on_the_gguf():
    tok = Tokenizer(prepare_gguf_model_dir(REAL_GGUF_PATH))
    assert 151645 in tok.eos_token_ids  # <|im_end|>
    engine = build_engine(
        EngineConfig(model=str(REAL_GGUF_PATH), max_model_len=2048, dtype="float32"),
        eos_token_ids=tok.eos_token_ids,
    )
    prompts = [
        tok.encode(tok.apply_chat_template(m, add_generation_prompt=True)) for m in CHAT_PROMPTS
    ]
    for messages, ids in zip(CHAT_PROMPTS, prompts):
        assert ids == gguf_chat_prompt_ids(REAL_GGUF_PATH, messages)
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    eos = sorted(tok.eos_token_ids)
    for messages, out in zip(CHAT_PROMPTS, outs):
        expected = transformers_gguf_greedy_ids(REAL_GGUF_PATH, messages, MAX_NEW, eos)
        assert out == expected, (tok.decode(out), tok.decode(expected))
