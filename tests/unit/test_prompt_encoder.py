"""PromptEncoder: tiktoken's BPE on the request path gives exactly the ids of tokenizers, or is
not used."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from engine.frontend.tokenizer import Tokenizer
from engine.loader.embedded import ensure_embedded_checkpoint
from server.prompt_encoder import CHECK_TEXTS, PromptEncoder
from tests.unit.test_tokenizer import SAMPLES, _random_text


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(ensure_embedded_checkpoint())


@pytest.fixture(scope="module")
def encoder(tok) -> PromptEncoder:
    return PromptEncoder(tok)


def test_qwen_tokenizer_takes_the_tiktoken_path(encoder):
    assert encoder.backend == "tiktoken"


def test_same_ids_as_tokenizers(tok, encoder):
    rng = random.Random(7)
    texts = list(SAMPLES) + list(CHECK_TEXTS) + [_random_text(rng) for _ in range(300)]
    # NFD text around added tokens: NFC must not join a mark with the token's last character
    texts += [
        "<think>\u0338x",
        "e\u0301<|im_end|>\u0301",
        "<|im_start|>>\u0338",
        "a\u0308<tool_call>\u0308",
    ]
    # decodings of random ids, added tokens included: words tokenizers has never cached
    texts += [
        tok.decode(
            [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 400))],
            skip_special_tokens=False,
        )
        for _ in range(100)
    ]
    for text in texts:
        assert encoder.encode(text) == tok.encode(text), repr(text)


def test_lone_surrogates_fail_as_in_tokenizers(tok, encoder):
    with pytest.raises(Exception) as ref:
        tok.encode("a\ud800b")
    with pytest.raises(type(ref.value)):
        encoder.encode("a\ud800b")


def _edited_copy(tmp_path, edit) -> Tokenizer:
    src = ensure_embedded_checkpoint()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / name)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    edit(spec)
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    return Tokenizer(tmp_path)


@pytest.mark.parametrize(
    "edit",
    [
        lambda s: s.update(normalizer={"type": "NFKC"}),
        lambda s: s["added_tokens"][0].update(lstrip=True),
        lambda s: s["model"]["merges"].reverse(),
        lambda s: s.update(
            truncation={
                "direction": "Right",
                "max_length": 8,
                "strategy": "LongestFirst",
                "stride": 0,
            }
        ),
    ],
    ids=["nfkc-normalizer", "lstrip-added-token", "merges-not-in-rank-order", "truncation"],
)
def test_other_shapes_fall_back_to_tokenizers(tmp_path, edit):
    tok = _edited_copy(tmp_path, edit)
    enc = PromptEncoder(tok)
    assert enc.backend == "tokenizers"
    text = "Ｆｕｌｌ width <|endoftext|> text"
    assert enc.encode(text) == tok.encode(text)


def test_long_prompts_are_encoded_off_the_event_loop(tok, encoder):
    """A long prompt is encoded in a worker thread (the encoders release the GIL), a short one
    inline."""
    import asyncio
    import threading

    from server.context import ServerContext

    ctx = ServerContext(engine=None, tokenizer=tok, model_name="m", metrics=None, encoder=encoder)
    threads = []
    real = ctx.encode_prompt
    ctx.encode_prompt = lambda *a: threads.append(threading.get_ident()) or real(*a)
    long_text = "word " * (ServerContext.ENCODE_IN_THREAD_CHARS // 5 + 1)

    async def main():
        loop_thread = threading.get_ident()
        ids_long = await ctx.encode_prompt_async(long_text)
        ids_short = await ctx.encode_prompt_async("short prompt")
        return loop_thread, ids_long, ids_short

    loop_thread, ids_long, ids_short = asyncio.run(main())
    assert ids_long == tok.encode(long_text) and ids_short == tok.encode("short prompt")
    assert threads[0] != loop_thread and threads[1] == loop_thread


def test_tokenizers_encode_releases_the_gil(tok):
    """Tokenizer.encode lets other Python threads run meanwhile (encode_batch drops the GIL)."""
    import threading
    import time

    text = tok.decode(list(range(1000, 1000 + 3000)), skip_special_tokens=False) * 4
    done = threading.Event()
    ticks = []

    def ticker():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0)

    t = threading.Thread(target=ticker)
    t.start()
    time.sleep(0.01)
    start = time.perf_counter()
    for _ in range(5):
        tok.encode(text)
    end = time.perf_counter()
    done.set()
    t.join()
    inside = [x for x in ticks if start <= x <= end]
    gaps = [b - a for a, b in zip(inside, inside[1:])]
    # with the GIL held for a whole encode call the other thread would stall for the call's length
    assert inside and max(gaps) < 0.5 * (end - start) / 5


def test_split_points_are_pre_token_boundaries(tok):
    """Encoding the pieces between split points gives the whole text's ids (tiktoken's BPE on
    the whole text, which the start-up check ties to tokenizers), for random texts cut at every
    boundary found."""
    import tiktoken  # noqa: F401 - the fast path's dependency

    from server.prompt_encoder import _TiktokenBPE, split_points

    bpe = _TiktokenBPE.from_tokenizer_json(tok.path / "tokenizer.json")
    rng = random.Random(11)
    checked = 0
    for _ in range(60):
        text = "".join(_random_text(rng) for _ in range(rng.randint(2, 12)))
        text += tok.decode([rng.randrange(151643) for _ in range(rng.randint(1, 300))])
        cuts = split_points(text, max(2, len(text) // 16))
        bounds = [0, *cuts, len(text)]
        ids = [i for a, b in zip(bounds, bounds[1:]) for i in bpe._encode_ordinary(text[a:b])]
        assert ids == bpe._encode_ordinary(text), repr(text)
        checked += len(cuts)
    assert checked > 200  # the texts had boundaries to test


def test_split_points_edge_cases():
    from server.prompt_encoder import split_points

    assert split_points("的一是不了人我在有他这中大来上国个到说们为" * 50, 4) == []
    assert split_points("abc def", 1) == []
    text = "word " * 1000
    cuts = split_points(text, 4)
    assert len(cuts) == 3 and cuts == sorted(set(cuts))
    assert all(text[c] == " " and text[c - 1].isalpha() for c in cuts)


def test_long_texts_encode_in_parallel_pieces(tok, monkeypatch):
    """With small pieces and several threads, long texts (random-token decodes, mixed scripts,
    added tokens) encode to tokenizers' ids through the threaded path."""
    import server.prompt_encoder as pe

    monkeypatch.setattr(pe, "PIECE_CHARS", 64)
    monkeypatch.setattr(pe, "ENCODE_THREADS", 4)
    enc = PromptEncoder(tok)
    assert enc.backend == "tiktoken" and enc._enc._splittable
    calls = []
    real = enc._enc._encode_ordinary
    enc._enc._encode_ordinary = lambda t: calls.append(t) or real(t)
    rng = random.Random(5)
    for _ in range(30):
        text = "".join(_random_text(rng) for _ in range(rng.randint(20, 60)))
        text += "<|im_end|>" + tok.decode([rng.randrange(151643) for _ in range(500)])
        calls.clear()
        assert enc.encode(text) == tok.encode(text), repr(text)
        assert len(calls) > 4  # two segments around <|im_end|>, each cut into pieces
