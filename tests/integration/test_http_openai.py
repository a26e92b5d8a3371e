"""Real HTTP against the embedded-model server with the official openai client."""

from __future__ import annotations

import httpx
import openai
import pytest

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hello in three words."},
]


def test_models_and_health(server, client):
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    head = httpx.head(server.base_url + "/health")  # load balancers probe with HEAD too
    assert head.status_code == 200 and head.content == b""
    models = client.models.list()
    assert [m.id for m in models.data] == ["qwen3-embedded"]


def test_chat_streaming_equals_non_streaming(client, tokenizer):
    kwargs = dict(
        model="qwen3-embedded",
        messages=MESSAGES,
        temperature=0,
        max_tokens=24,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    full = client.chat.completions.create(**kwargs)
    choice = full.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")

    prompt = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, enable_thinking=False
    )
    assert full.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert full.usage.completion_tokens == 24 or choice.finish_reason == "stop"
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [c for c in chunks if c.choices]
    finishes = [c.choices[0].finish_reason for c in content_chunks]
    assert finishes[-1] == choice.finish_reason and all(f is None for f in finishes[:-1])
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    )
    assert all(c.id == chunks[0].id and c.model == "qwen3-embedded" and c.created for c in chunks)
    streamed = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert streamed == (choice.message.content or "")
    # the non-streamed text is the detokenized output (EOS not included)
    assert full.usage.completion_tokens > 0


def test_raw_sse_framing_and_done(server):
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST", server.base_url + "/v1/chat/completions", json=body, timeout=120
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_text_completion(client, tokenizer):
    out = client.completions.create(
        model="qwen3-embedded", prompt="Hello world", max_tokens=5, temperature=0
    )
    assert out.object == "text_completion"
    assert out.usage.prompt_tokens == 2
    assert out.usage.completion_tokens == 5 or out.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="qwen3-embedded", prompt="Hello world", max_tokens=5, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == out.choices[0].text


def test_bad_requests_get_openai_400(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="qwen3-embedded", messages=MESSAGES, temperature=5)
    assert e.value.body["param"] == "temperature"
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(server.base_url + "/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES)
