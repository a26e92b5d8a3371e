"""``ServerContext.encode_request_prompt``: vLLM's ``add_special_tokens`` applies the tokenizer's
post-processor. Qwen's adds nothing, so this runs on a copy of the embedded tokenizer whose
post-processor adds a BOS, against transformers' fast tokenizer on the same file."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading

import pytest

from engine.frontend.tokenizer import Tokenizer
from engine.loader.embedded import ensure_embedded_checkpoint
from server.context import ServerContext
from server.prompt_encoder import PromptEncoder

BOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def bos_checkpoint(tmp_path_factory):
    src = ensure_embedded_checkpoint()
    dst = tmp_path_factory.mktemp("bos")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    spec = json.loads((dst / "tokenizer.json").read_text())
    bos_id = next(t["id"] for t in spec["added_tokens"] if t["content"] == BOS)
    seq_a, seq_b = {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": BOS, "type_id": 0}}, seq_a],
        "pair": [seq_a, seq_b],
        "special_tokens": {BOS: {"id": BOS, "ids": [bos_id], "tokens": [BOS]}},
    }
    (dst / "tokenizer.json").write_text(json.dumps(spec))
    return dst


def _context(tokenizer: Tokenizer) -> ServerContext:
    encoder = PromptEncoder(tokenizer)
    return ServerContext(
        engine=None, tokenizer=tokenizer, model_name="m", metrics=None, encoder=encoder
    )


@pytest.mark.parametrize("chars", [40, 9000], ids=["inline", "worker-thread"])
def test_add_special_tokens_applies_the_post_processor(bos_checkpoint, chars):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(bos_checkpoint / "tokenizer.json"))
    ctx = _context(Tokenizer(bos_checkpoint))
    assert ctx.special_tokens_added
    text = ("Hello there, 世界! " * 600)[:chars]
    threads = []
    encode = ctx.encode_with_special_tokens

    def recording(*args):
        threads.append(threading.get_ident())
        return encode(*args)

    ctx.encode_with_special_tokens = recording
    for flag in (True, False):
        ids = asyncio.run(ctx.encode_request_prompt(text, "prompt", flag))
        assert ids == hf(text, add_special_tokens=flag)["input_ids"], flag
    # long prompts leave the event loop's thread (this one, under asyncio.run)
    assert len(threads) == 1 and (threads[0] == threading.get_ident()) == (
        chars < ServerContext.ENCODE_IN_THREAD_CHARS
    )
    assert asyncio.run(ctx.encode_request_prompt(text, "prompt", True))[
        0
    ] == hf.convert_tokens_to_ids(BOS)


def test_qwen_post_processor_adds_nothing():
    ctx = _context(Tokenizer(ensure_embedded_checkpoint()))
    assert not ctx.special_tokens_added
    ids = asyncio.run(ctx.encode_request_prompt("Hello", "prompt", True))
    assert ids == ctx.tokenizer.encode("Hello")
