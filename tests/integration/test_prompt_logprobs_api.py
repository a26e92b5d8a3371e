"""Prompt log-probabilities over HTTP on a tiny random checkpoint, against transformers' float32
forward: the legacy ``echo`` + ``logprobs`` shape (streamed and not), vLLM's ``prompt_logprobs``
on both endpoints, ``return_tokens_as_token_ids`` and score-only ``max_tokens: 0``."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from tests.metricsutil import num_kv_blocks, scrape
from tests.serverproc import ServerProcess

PROMPT = "The capital of France is Paris. A cat sat on the mat"


@pytest.fixture(scope="module")
def served(tiny_served_checkpoint):
    path, hf = tiny_served_checkpoint
    srv = ServerProcess(
        "--model", path, "--served-model-name", "tiny", "--max-num-batched-tokens", "8"
    ).wait_ready()
    yield srv, AutoTokenizer.from_pretrained(path), hf
    srv.stop()


def _ref(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def _post(srv, path, body) -> dict:
    r = httpx.post(srv.base_url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_logprobs_streamed_equals_non_streamed_and_transformers(served):
    srv, tok, hf = served
    ids = tok(PROMPT)["input_ids"]
    ref = _ref(hf, ids)
    body = {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0}
    out = _post(srv, "/v1/completions", body)["choices"][0]
    lp = out["logprobs"]
    assert lp["tokens"][: len(ids)] == [tok.decode([i]) for i in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for j in range(1, len(ids)):
        assert abs(lp["token_logprobs"][j] - ref[j - 1, ids[j]].item()) < 1e-4
        top = lp["top_logprobs"][j]
        top_v, top_i = ref[j - 1].topk(2)
        assert {tok.decode([i]) for i in top_i.tolist()} <= set(top) and len(top) <= 3
        assert max(top.values()) == pytest.approx(top_v[0].item(), abs=1e-4)
    assert len(lp["tokens"]) == len(ids) + 3
    assert out["text"].startswith(PROMPT)

    with httpx.stream(
        "POST", srv.base_url + "/v1/completions", json={**body, "stream": True}, timeout=120
    ) as r:
        chunks = [
            json.loads(line[6:])
            for line in r.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    text = ""
    for c in chunks:
        ch = c["choices"][0]
        text += ch["text"]
        for k in merged:
            merged[k] += (ch["logprobs"] or {}).get(k, [])
    assert chunks[0]["choices"][0]["text"] == tok.decode(ids)  # the echo chunk comes first
    assert text == out["text"]
    assert merged["tokens"] == lp["tokens"] and merged["text_offset"] == lp["text_offset"]
    assert merged["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-5)


def test_prompt_logprobs_on_completions_and_chat(served):
    srv, tok, hf = served
    ids = tok(PROMPT)["input_ids"]
    ref = _ref(hf, ids)
    out = _post(srv, "/v1/completions", {"prompt": ids, "prompt_logprobs": 3, "max_tokens": 1})
    plps = out["choices"][0]["prompt_logprobs"]
    assert plps[0] is None and len(plps) == len(ids)
    for j in range(1, len(ids)):
        entry = plps[j]
        actual = entry[str(ids[j])]
        row = ref[j - 1]
        assert abs(actual["logprob"] - row[ids[j]].item()) < 1e-4
        assert actual["rank"] == int((row > row[ids[j]]).sum()) + 1
        assert actual["decoded_token"] == tok.decode([ids[j]])
        top_v, top_i = row.topk(3)
        for r, (i, v) in enumerate(zip(top_i.tolist(), top_v.tolist()), 1):
            assert entry[str(i)]["rank"] == r and abs(entry[str(i)]["logprob"] - v) < 1e-4
        assert len(entry) in (3, 4)

    messages = [{"role": "user", "content": "what is two plus two?"}]
    chat = _post(
        srv, "/v1/chat/completions", {"messages": messages, "prompt_logprobs": 0, "max_tokens": 1}
    )
    chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)
    assert chat["usage"]["prompt_tokens"] == len(chat_ids)
    cref = _ref(hf, chat_ids)
    cp = chat["prompt_logprobs"]
    assert cp[0] is None and len(cp) == len(chat_ids)
    for j in range(1, len(chat_ids)):
        assert list(cp[j]) == [str(chat_ids[j])]  # k = 0: the token itself only
        assert abs(cp[j][str(chat_ids[j])]["logprob"] - cref[j - 1, chat_ids[j]].item()) < 1e-4


def test_tokens_as_token_ids_and_score_only(served):
    srv, tok, hf = served
    ids = tok(PROMPT)["input_ids"]
    body = {
        "prompt": ids,
        "echo": True,
        "logprobs": 5,
        "max_tokens": 0,
        "return_tokens_as_token_ids": True,
    }
    out = _post(srv, "/v1/completions", body)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 0
    assert choice["text"] == tok.decode(ids)
    lp = choice["logprobs"]
    assert lp["tokens"] == [f"token_id:{i}" for i in ids]
    ref = _ref(hf, ids)
    for j in range(1, len(ids)):
        top = lp["top_logprobs"][j]
        top_i = ref[j - 1].topk(5).indices.tolist()
        assert {f"token_id:{i}" for i in top_i} <= set(top)  # distinct keys, no collisions
        assert top[f"token_id:{ids[j]}"] == pytest.approx(ref[j - 1, ids[j]].item(), abs=1e-4)


def test_score_only_prompt_may_fill_the_whole_context(tiny_served_checkpoint):
    """``max_tokens: 0`` keeps no token, so a prompt of exactly ``--max-model-len`` tokens is
    scored (a whole window of a rolling log-likelihood), equal to transformers, in chunks and
    at a KV-block boundary (32 tokens = 2 blocks of 16); one token more, or any generated
    token, is a 400 naming the prompt or max_tokens; every KV block is free afterwards."""
    path, hf = tiny_served_checkpoint
    n = 32
    # a fixed KV cache: on a GPU the module's other server holds most of the memory
    srv = ServerProcess(
        "--model", path, "--max-model-len", str(n), "--max-num-batched-tokens", "8",
        "--num-kv-blocks", "16",
    ).wait_ready()  # fmt: skip
    try:
        ids = torch.randint(0, hf.config.vocab_size, (n,)).tolist()
        ref = _ref(hf, ids)
        out = _post(
            srv, "/v1/completions", {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0}
        )
        lp = out["choices"][0]["logprobs"]["token_logprobs"]
        assert lp[0] is None and len(lp) == n and out["usage"]["completion_tokens"] == 0
        for j in range(1, n):
            assert abs(lp[j] - ref[j - 1, ids[j]].item()) < 1e-4
        out = _post(srv, "/v1/completions", {"prompt": ids, "prompt_logprobs": 0, "max_tokens": 0})
        plps = out["choices"][0]["prompt_logprobs"]
        assert [p[str(i)]["logprob"] for p, i in zip(plps[1:], ids[1:])] == pytest.approx(
            lp[1:], abs=1e-5
        )
        for body, param in [
            ({"prompt": ids + [1], "echo": True, "logprobs": 1, "max_tokens": 0}, "prompt"),
            ({"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1}, "prompt"),
            ({"prompt": ids[:20]}, "prompt"),  # the default 16 tokens: the field was not sent
            ({"prompt": ids[:20], "max_tokens": 16}, "max_tokens"),
        ]:
            r = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "context_length_exceeded" and err["param"] == param, err
            assert ("the default max_tokens" in err["message"]) == ("max_tokens" not in body), err
        m = scrape(srv.base_url)
        assert m["qwen_serve:num_free_kv_blocks"] == num_kv_blocks(m), m
    finally:
        srv.stop()
