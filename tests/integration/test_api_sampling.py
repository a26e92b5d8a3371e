"""Sampling parameters, stop conditions, n, logprobs, echo, defaults and streaming, over real HTTP.

All requests go to the session ``server`` (embedded random-weight Qwen3, real engine, real
tokenizer) through the official openai client, or raw httpx where the client cannot express a
check. The random model's outputs are arbitrary but fixed under greedy decoding, so each test
first asks for a reference output and then checks how a parameter changes it: a stop string is
picked across a token boundary of the greedy text, a logit bias makes a known token win, a
penalty must break a repetition that a bias created, and so on.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import torch

from engine.core.config import read_generation_config
from engine.loader.embedded import ensure_embedded_checkpoint
from server.params import generation_defaults, to_sampling_params
from server.protocol import ChatCompletionRequest, CompletionRequest

MODEL = "qwen3-embedded"
PROMPT = "Hello world"
MESSAGES = [{"role": "user", "content": "Tell me a short story."}]
EOS = 151645  # <|im_end|>, the tokenizer's eos_token
ENDOFTEXT = 151643  # <|endoftext|>, the other EOS id of generation_config
APPLE = 23268  # " apple", one token
FFFD = "\ufffd"


def aclient(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120
    )


#: vLLM-style fields the openai client has no argument for (sent through extra_body)
EXTRA_FIELDS = {
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "include_stop_str_in_output",
    "chat_template_kwargs",
}


def with_extra(kw: dict) -> dict:
    extra = {k: kw.pop(k) for k in list(kw) if k in EXTRA_FIELDS}
    if extra:
        kw["extra_body"] = {**kw.get("extra_body", {}), **extra}
    return kw


def complete(client, **kw):
    kw = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 16, **kw}
    return client.completions.create(**with_extra(kw))


def chat(client, **kw):
    kw = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 16, **kw}
    return client.chat.completions.create(**with_extra(kw))


def streamed_completion(client, **kw) -> tuple[dict[int, str], dict[int, str], list]:
    """(text per choice index, finish_reason per index, chunks) of a streamed text completion."""
    chunks = list(complete(client, stream=True, **kw))
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    return texts, finishes, chunks


def streamed_chat(client, **kw) -> tuple[dict[int, str], dict[int, str], list]:
    """(content per choice index, finish_reason per index, chunks) of a streamed chat completion."""
    chunks = list(chat(client, stream=True, **kw))
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    return texts, finishes, chunks


def stop_reason(choice):
    """vLLM's ``stop_reason`` of a response or finish-chunk choice ("absent" when missing)."""
    return (choice.model_extra or {}).get("stop_reason", "absent")


def streamed_stop_reasons(chunks) -> dict[int, object]:
    """``stop_reason`` of each choice's finish chunk."""
    return {ch.index: stop_reason(ch) for c in chunks for ch in c.choices if ch.finish_reason}


def boundary_stop(pieces: list[str], text: str, skip: int = 2) -> tuple[str, int]:
    """A stop string made of the last 2 characters of one token and the first 2 of the next
    (so it spans a token boundary), occurring first at that boundary; returns (stop, start)."""
    pos = 0
    for i in range(len(pieces) - 1):
        a, b = pieces[i], pieces[i + 1]
        pos += len(a)
        if FFFD in a + b or text[:pos] != "".join(pieces[: i + 1]):
            break
        if i >= skip and len(a.strip()) >= 2 and len(b.strip()) >= 2:
            stop = text[pos - 2 : pos + 2]
            if text.find(stop) == pos - 2:
                return stop, pos - 2
    raise AssertionError(f"no usable token boundary in {pieces!r}")


def repeats(tokens: list[str]) -> int:
    return len(tokens) - len(set(tokens))


# ---------------------------------------------------------------- greedy, temperature, truncation
def test_greedy_is_deterministic_and_streaming_equals_non_streaming(client):
    a = chat(client)
    b = chat(client, top_p=0.3, top_k=3)  # truncation does not matter at temperature 0
    assert a.choices[0].message.content == b.choices[0].message.content
    texts, finishes, _ = streamed_chat(client)
    assert texts[0] == a.choices[0].message.content and finishes[0] == a.choices[0].finish_reason

    c = complete(client)
    texts, finishes, _ = streamed_completion(client, n=2)
    assert texts == {0: c.choices[0].text, 1: c.choices[0].text}
    assert finishes == {0: c.choices[0].finish_reason, 1: c.choices[0].finish_reason}


def test_top_k_top_p_min_p_per_request_in_one_batch(server, client):
    """Requests with different sampling settings share engine steps; each keeps its own settings:
    top_k=1, a tiny top_p and min_p=1 leave only the most likely token, so they equal greedy
    decoding even at high temperature, while plain temperature-1 sampling does not."""
    greedy = complete(client, max_tokens=12).choices[0].text

    async def run():
        async with aclient(server) as ac:
            kws = [
                dict(temperature=0),
                dict(temperature=1.0, top_k=1),
                dict(temperature=1.5, top_p=1e-6),
                dict(temperature=2.0, min_p=1.0),
                dict(temperature=1.0, seed=5),
                dict(temperature=1.0, top_k=1, seed=9),
            ]
            outs = await asyncio.gather(
                *(
                    ac.completions.create(
                        model=MODEL, prompt=PROMPT, max_tokens=12, **with_extra(kw)
                    )
                    for kw in kws
                )
            )
            return [o.choices[0].text for o in outs]

    texts = asyncio.run(run())
    assert texts[0] == texts[1] == texts[2] == texts[3] == texts[5] == greedy
    assert texts[4] != greedy


def test_lower_temperature_picks_likelier_tokens(client):
    """Seeded samples at temperature 0.05 have a higher mean (raw) log-probability than at 2.0
    (no top_k / top_p truncation, which the checkpoint defaults would otherwise apply)."""

    def mean_lp(t):
        out = complete(
            client, temperature=t, seed=11, max_tokens=24, logprobs=0, top_k=-1, top_p=1.0
        )
        lps = out.choices[0].logprobs.token_logprobs
        return sum(lps) / len(lps)

    assert mean_lp(0.05) > mean_lp(2.0) + 0.3


# ---------------------------------------------------------------- seed
def test_seed_gives_the_same_text_alone_and_among_concurrent_requests(server, client):
    seeded = dict(temperature=1.0, seed=1234, max_tokens=12)
    alone = chat(client, **seeded).choices[0].message.content
    assert chat(client, **seeded).choices[0].message.content == alone
    texts, _, _ = streamed_chat(client, **seeded)
    assert texts[0] == alone

    async def run():
        async with aclient(server) as ac:
            others = [
                ac.chat.completions.create(
                    model=MODEL, messages=MESSAGES, temperature=0, max_tokens=16
                ),
                ac.chat.completions.create(
                    model=MODEL,
                    messages=MESSAGES,
                    temperature=0.7,
                    top_p=0.9,
                    seed=7,
                    max_tokens=14,
                    extra_body={"top_k": 5},
                ),
                ac.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "Other prompt " * 20}],
                    temperature=1.2,
                    presence_penalty=1.5,
                    frequency_penalty=0.5,
                    logit_bias={str(APPLE): 3},
                    n=2,
                    max_tokens=10,
                ),
                ac.completions.create(
                    model=MODEL,
                    prompt="x y z",
                    temperature=1.0,
                    max_tokens=15,
                    logprobs=3,
                    extra_body={"min_p": 0.1, "repetition_penalty": 1.3},
                ),
            ]
            target = ac.chat.completions.create(model=MODEL, messages=MESSAGES, **seeded)
            res = await asyncio.gather(target, *others)
            return res[0].choices[0].message.content

    assert asyncio.run(run()) == alone
    other_seed = chat(client, temperature=1.0, seed=4321, max_tokens=12).choices[0].message.content
    assert other_seed != alone


# ---------------------------------------------------------------- logit_bias and penalties
def test_logit_bias(client, tokenizer):
    out = complete(client, max_tokens=5, logit_bias={str(APPLE): 100})
    assert out.choices[0].text == " apple" * 5
    out = chat(client, max_tokens=4, logit_bias={str(APPLE): 100})
    assert out.choices[0].message.content == " apple" * 4

    base = complete(client, max_tokens=3, logprobs=0)
    first = base.choices[0].logprobs.tokens[0]
    first_ids = tokenizer.encode(first)
    assert len(first_ids) == 1 and tokenizer.decode(first_ids) == first
    banned = complete(client, max_tokens=3, logprobs=0, logit_bias={str(first_ids[0]): -100})
    assert banned.choices[0].logprobs.tokens[0] != first


def test_presence_frequency_and_repetition_penalties(client):
    """A +2 logit bias makes " apple" win most greedy steps; penalties must break that repetition.
    Presence subtracts a constant once a token appeared, frequency grows with its count, and the
    repetition penalty also counts prompt tokens."""
    bias = {str(APPLE): 2}

    def toks(prompt=PROMPT, logit_bias=bias, **kw):
        out = complete(
            client, prompt=prompt, max_tokens=24, logprobs=0, logit_bias=logit_bias, **kw
        )
        return out.choices[0].logprobs.tokens

    base = toks()
    assert base.count(" apple") >= 10 and repeats(base) >= 10
    for kw in (
        dict(presence_penalty=2.0),
        dict(frequency_penalty=2.0),
        dict(repetition_penalty=2.0),
    ):
        pen = toks(**kw)
        assert pen != base, kw
        assert 1 <= pen.count(" apple") <= 2 and repeats(pen) < repeats(base), (kw, pen)
    # frequency (grows per occurrence) beats presence (constant) at the same small strength
    assert toks(frequency_penalty=0.5).count(" apple") < toks(presence_penalty=0.5).count(" apple")
    # the repetition penalty sees the prompt: with " apple" in the prompt it never wins; presence
    # (generated tokens only) still lets it appear once
    assert toks(prompt="Hello apple", repetition_penalty=2.0).count(" apple") == 0
    assert toks(prompt="Hello apple", presence_penalty=2.0).count(" apple") == 1
    # negative penalties encourage repetition
    assert repeats(toks(presence_penalty=-2.0, logit_bias={})) > repeats(toks(logit_bias={}))


# ---------------------------------------------------------------- stop strings and tokens
def test_stop_strings_spanning_token_boundaries_never_leak(client):
    ref = complete(client, max_tokens=24, logprobs=0)
    text, pieces = ref.choices[0].text, ref.choices[0].logprobs.tokens
    stop, start = boundary_stop(pieces, text)
    never = text[start - 3 : start] + "\u2603never"  # its prefix appears in the text, then fails
    tail = (
        text[-3:] + "\u2603"
    )  # a possible stop string at the very end, resolved by the length limit
    cases = [
        (dict(stop=stop), text[:start], "stop"),
        (dict(stop=[never, stop]), text[:start], "stop"),
        (dict(stop=[never]), text, "length"),
        (dict(stop=tail), text, "length"),
        (dict(stop=stop, include_stop_str_in_output=True), text[: start + len(stop)], "stop"),
    ]
    for kw, expected, reason in cases:
        matched = stop if reason == "stop" else None  # vLLM's stop_reason: the string matched
        out = complete(client, max_tokens=24, **kw)
        assert (out.choices[0].text, out.choices[0].finish_reason) == (expected, reason), kw
        assert stop_reason(out.choices[0]) == matched, kw
        texts, finishes, chunks = streamed_completion(client, max_tokens=24, **kw)
        assert (texts[0], finishes[0]) == (expected, reason), kw
        assert streamed_stop_reasons(chunks) == {0: matched}, kw
        if "include_stop_str_in_output" not in kw and reason == "stop":
            acc = ""
            for c in chunks:  # no prefix of the streamed text ever contains the stop string
                acc += c.choices[0].text if c.choices else ""
                assert stop not in acc


def test_chat_stop_string_spanning_token_boundary(client):
    ref = chat(client, max_tokens=24, logprobs=True)
    text = ref.choices[0].message.content
    pieces = [e.token for e in ref.choices[0].logprobs.content]
    stop, start = boundary_stop(pieces, text)
    out = chat(client, max_tokens=24, stop=[stop])
    assert out.choices[0].message.content == text[:start] and out.choices[0].finish_reason == "stop"
    assert stop_reason(out.choices[0]) == stop
    texts, finishes, chunks = streamed_chat(client, max_tokens=24, stop=stop)
    assert texts[0] == text[:start] and finishes[0] == "stop"
    assert streamed_stop_reasons(chunks) == {0: stop}
    short = chat(client, max_tokens=3).choices[0]
    assert (short.finish_reason, stop_reason(short)) == ("length", None)
    assert all(stop not in (c.choices[0].delta.content or "") for c in chunks if c.choices)


def test_stop_token_ids(client, tokenizer):
    ref = complete(client, max_tokens=12, logprobs=0)
    pieces = ref.choices[0].logprobs.tokens
    k = next(
        i
        for i, p in enumerate(pieces)
        if i >= 3
        and FFFD not in "".join(pieces[: i + 1])
        and len(tokenizer.encode(p)) == 1
        and pieces.index(p) == i
    )
    tok_id = tokenizer.encode(pieces[k])[0]
    out = complete(client, max_tokens=12, stop_token_ids=[tok_id])
    assert out.choices[0].text == "".join(pieces[:k])  # the stop token's own text is not included
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == k + 1
    assert stop_reason(out.choices[0]) == tok_id  # vLLM's stop_reason: the id that ended it
    texts, finishes, chunks = streamed_completion(client, max_tokens=12, stop_token_ids=[tok_id])
    assert (texts[0], finishes[0]) == ("".join(pieces[:k]), "stop")
    assert streamed_stop_reasons(chunks) == {0: tok_id}
    # text completion chunks carry stop_reason on every choice, null before the finish (vLLM)
    assert all(stop_reason(ch) is None for c in chunks for ch in c.choices if not ch.finish_reason)
    # chat, the stop token forced as the first output token
    forced = dict(max_tokens=8, logit_bias={str(tok_id): 100}, stop_token_ids=[tok_id])
    out = chat(client, **forced)
    assert (out.choices[0].finish_reason, out.usage.completion_tokens) == ("stop", 1)
    assert stop_reason(out.choices[0]) == tok_id
    _, finishes, chunks = streamed_chat(client, **forced)
    assert finishes == {0: "stop"} and streamed_stop_reasons(chunks) == {0: tok_id}


def test_eos_ignore_eos_and_min_tokens(client):
    eos_bias = {str(EOS): 100}
    out = chat(client, logit_bias=eos_bias)
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 1
    assert out.choices[0].message.content == ""
    assert stop_reason(out.choices[0]) is None  # EOS: no stop_reason, as in vLLM
    # EOS reports no stop_reason even when it is listed in stop_token_ids (vLLM checks EOS first)
    out = chat(client, logit_bias=eos_bias, stop_token_ids=[EOS])
    assert out.choices[0].finish_reason == "stop" and stop_reason(out.choices[0]) is None
    # ... unless ignore_eos: then a listed EOS is a plain stop token
    out = chat(client, logit_bias=eos_bias, stop_token_ids=[EOS], ignore_eos=True)
    assert out.choices[0].finish_reason == "stop" and stop_reason(out.choices[0]) == EOS
    # <|endoftext|>, an EOS id only generation_config adds: vLLM makes it a stop token id
    out = chat(client, logit_bias={str(ENDOFTEXT): 100})
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 1
    assert stop_reason(out.choices[0]) == ENDOFTEXT
    out = chat(client, logit_bias=eos_bias, min_tokens=5)
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 6
    assert out.choices[0].message.content
    out = chat(client, logit_bias=eos_bias, max_tokens=5, ignore_eos=True)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    out = complete(client, logit_bias=eos_bias, max_tokens=4, ignore_eos=True, min_tokens=2)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4


def test_max_tokens_and_max_completion_tokens(client):
    out = chat(client, max_tokens=3)
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_completion_tokens=2
    )
    assert out.usage.completion_tokens == 2 and out.choices[0].finish_reason == "length"
    # max_completion_tokens wins over the deprecated max_tokens
    out = chat(client, max_tokens=6, max_completion_tokens=4)
    assert out.usage.completion_tokens == 4
    # text completions default to 16 tokens (OpenAI's default)
    out = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0)
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"


# ---------------------------------------------------------------- n
def test_n_choices(client):
    out = chat(client, n=3, temperature=1.0, seed=42, max_tokens=8)
    assert [c.index for c in out.choices] == [0, 1, 2]
    contents = [c.message.content for c in out.choices]
    assert len(set(contents)) == 3
    assert out.usage.completion_tokens == 24  # 8 each (choice 0 samples EOS as its 8th token)
    texts, finishes, chunks = streamed_chat(client, n=3, temperature=1.0, seed=42, max_tokens=8)
    assert texts == dict(enumerate(contents))
    assert finishes == {c.index: c.finish_reason for c in out.choices}
    roles = [
        c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"
    ]
    assert sorted(roles) == [0, 1, 2]

    out = complete(client, prompt=["Hello world", "Goodbye"], n=2, max_tokens=4)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text != out.choices[2].text == out.choices[3].text
    assert out.usage.completion_tokens == 16


# ---------------------------------------------------------------- logprobs
@pytest.fixture(scope="module")
def hf():
    """transformers' own tokenizer and Qwen3ForCausalLM on the embedded checkpoint (the
    reference)."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    path = ensure_embedded_checkpoint()
    return AutoTokenizer.from_pretrained(path), Qwen3ForCausalLM.from_pretrained(
        path, torch_dtype=torch.float32
    ).eval()


def raw_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)


def test_chat_logprobs_are_the_raw_model_distribution(client, hf):
    hf_tok, model = hf
    ids = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    ref = raw_logprobs(model, ids)
    top_v, top_i = ref.topk(5)

    out = chat(client, max_tokens=4, logprobs=True, top_logprobs=5)
    assert out.usage.prompt_tokens == len(ids)
    entries = out.choices[0].logprobs.content
    assert len(entries) == 4
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True)
        assert e.token == e.top_logprobs[0].token and e.logprob == pytest.approx(tops[0])  # greedy
    first = entries[0]
    assert first.logprob == pytest.approx(top_v[0].item(), abs=1e-3)
    assert [t.logprob for t in first.top_logprobs] == pytest.approx(top_v.tolist(), abs=1e-3)
    assert [t.token for t in first.top_logprobs] == [hf_tok.decode([i]) for i in top_i.tolist()]
    # bytes are the tokens' real bytes: they concatenate to the content
    content = out.choices[0].message.content
    assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace") == content

    # sampling settings do not change the reported values: raw, not tempered or biased
    hot = chat(client, max_tokens=1, logprobs=True, temperature=1.5, top_k=1)
    assert hot.choices[0].logprobs.content[0].logprob == pytest.approx(top_v[0].item(), abs=1e-3)
    tempered = (
        torch.log_softmax(model(torch.tensor([ids])).logits[0, -1] / 1.5, dim=-1).max().item()
    )
    assert abs(tempered - top_v[0].item()) > 0.05
    biased = chat(client, max_tokens=1, logprobs=True, top_logprobs=0, logit_bias={str(APPLE): 100})
    e = biased.choices[0].logprobs.content[0]
    assert e.token == " apple" and e.top_logprobs == []
    assert e.logprob == pytest.approx(ref[APPLE].item(), abs=1e-3)


def test_completion_logprobs_and_echo(client, hf, tokenizer):
    hf_tok, model = hf
    ref = raw_logprobs(model, tokenizer.encode(PROMPT))
    top_v, top_i = ref.topk(3)
    out = complete(client, max_tokens=6, logprobs=3)
    lp = out.choices[0].logprobs
    text = out.choices[0].text
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    )
    assert lp.token_logprobs[0] == pytest.approx(top_v[0].item(), abs=1e-3)
    assert sorted(lp.top_logprobs[0].values(), reverse=True) == pytest.approx(
        top_v.tolist(), abs=1e-3
    )
    assert set(lp.top_logprobs[0]) == {hf_tok.decode([i]) for i in top_i.tolist()}
    for tlp, tops in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(tops) <= 3 and tlp == pytest.approx(max(tops.values()))  # greedy: the top one
    assert lp.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))

    echoed = complete(client, max_tokens=6, logprobs=1, echo=True)
    assert echoed.choices[0].text == PROMPT + text
    # echo + logprobs reports the prompt tokens first (the first has no logprob), then the
    # generated ones, as OpenAI's legacy API and vLLM do
    prompt_ids = tokenizer.encode(PROMPT)
    elp = echoed.choices[0].logprobs
    assert len(elp.tokens) == len(prompt_ids) + 6
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert elp.text_offset[0] == 0 and elp.text_offset[len(prompt_ids)] == len(PROMPT)
    with torch.no_grad():
        prompt_ref = torch.log_softmax(model(torch.tensor([prompt_ids])).logits[0].float(), -1)
    for j in range(1, len(prompt_ids)):
        assert elp.token_logprobs[j] == pytest.approx(
            prompt_ref[j - 1, prompt_ids[j]].item(), abs=1e-3
        )
    assert elp.token_logprobs[len(prompt_ids) :] == pytest.approx(lp.token_logprobs, abs=1e-4)
    texts, _, chunks = streamed_completion(client, max_tokens=6, echo=True)
    assert texts[0] == PROMPT + text and chunks[0].choices[0].text == PROMPT


# ---------------------------------------------------------------- defaults
def test_defaults_come_from_generation_config():
    defaults = generation_defaults(read_generation_config(ensure_embedded_checkpoint()))
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    common = dict(
        max_tokens=8,
        logprobs=None,
        num_prompt_tokens=10,
        max_model_len=2048,
        vocab_size=151936,
        defaults=defaults,
    )
    p = to_sampling_params(ChatCompletionRequest(messages=MESSAGES), **common)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (
        0.6,
        0.95,
        20,
        0.0,
        1.0,
    )
    p = to_sampling_params(
        ChatCompletionRequest(messages=MESSAGES, temperature=0, top_k=-1, top_p=1), **common
    )
    assert (p.temperature, p.top_p, p.top_k) == (0.0, 1.0, -1)
    p = to_sampling_params(CompletionRequest(prompt="x", top_p=0.5), **common)
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.5, 20)


def test_omitted_parameters_use_the_checkpoint_defaults_over_http(client):
    def text(**kw):
        return complete(client, max_tokens=10, **kw).choices[0].text

    omitted = dict(temperature=openai.NOT_GIVEN, seed=99)
    explicit = dict(temperature=0.6, top_p=0.95, seed=99, top_k=20)
    assert text(**omitted) == text(**explicit)
    assert text(**omitted) != text(temperature=1.0, top_p=1.0, seed=99, top_k=-1)
    # without a seed, two requests that leave temperature out are sampled, not greedy
    unseeded = [text(temperature=openai.NOT_GIVEN) for _ in range(2)]
    assert unseeded[0] != unseeded[1]


# ---------------------------------------------------------------- streaming shape
def test_stream_chunks_usage_and_no_empty_deltas(client):
    _, _, chunks = streamed_chat(client, max_tokens=8, n=2, stream_options={"include_usage": True})
    assert all(
        c.id == chunks[0].id and c.model == MODEL and c.created == chunks[0].created for c in chunks
    )
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 16
    assert last.usage.total_tokens == last.usage.prompt_tokens + 16
    assert all(c.usage is None for c in chunks[:-1])
    for c in chunks[:-1]:
        (ch,) = c.choices
        if ch.delta.role == "assistant":
            continue
        assert ch.delta.content or ch.finish_reason, c  # no empty content deltas
        assert not (ch.delta.content and ch.finish_reason)

    _, _, chunks = streamed_chat(client, max_tokens=4)
    assert all(c.usage is None and c.choices for c in chunks)

    _, _, chunks = streamed_completion(client, max_tokens=6, stream_options={"include_usage": True})
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.id == chunks[0].id and c.model == MODEL and c.created for c in chunks)
    assert all(ch.text or ch.finish_reason for c in chunks[:-1] for ch in c.choices)


def test_streamed_deltas_never_split_characters(server, client):
    """Greedy outputs of Chinese / emoji prompts (full of multi-byte characters): whenever the full
    text has no U+FFFD, no streamed delta has one, and the deltas concatenate to the non-streamed
    text. (The random model rarely samples a token holding part of a character; the scripted
    outputs of test_api_chat_semantics cover that case token by token.)"""
    wide = 0
    for prompt in ["你好，世界", "😀🎉👍", "数学题：一加一等于几？"]:
        full = complete(client, prompt=prompt, max_tokens=24).choices[0].text
        wide += sum(len(ch.encode()) > 1 for ch in full)
        with httpx.stream(
            "POST",
            server.base_url + "/v1/completions",
            timeout=120,
            json={
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": 24,
                "temperature": 0,
                "stream": True,
            },
        ) as r:
            deltas = [
                json.loads(line[6:])["choices"][0]["text"]
                for line in r.iter_lines()
                if line.startswith("data: {")
            ]
        assert "".join(deltas) == full
        if FFFD not in full:
            assert not any(FFFD in d for d in deltas), prompt
    assert wide >= 10
