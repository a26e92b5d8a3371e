"""``GET /v1/models/{id}``, ``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes, against
transformers' tokenizer and the chat endpoint's own usage counts."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from engine.loader.embedded import ensure_embedded_checkpoint

MODEL = "qwen3-embedded"
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a colour. Ünïcödé 😀"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def hf_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_embedded_checkpoint())


def _post(server, path: str, body) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def test_models_retrieve_with_the_openai_client(client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    assert card.model_extra.get("max_model_len") == 2048
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("gpt-4o")
    err = exc.value.body
    assert err["param"] == "model" and err["code"] == "model_not_found"
    listed = [m.id for m in client.models.list().data]
    assert listed == [MODEL]


def test_tokenize_prompt_matches_transformers(server, hf_tok):
    text = "The capital of France is Paris. Ünïcödé 😀 <|im_end|> tail"
    r = _post(server, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = hf_tok(text, add_special_tokens=True)["input_ids"]
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["max_model_len"] == 2048
    assert body["token_strs"] == hf_tok.convert_ids_to_tokens(expected)
    plain = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == hf_tok(text, add_special_tokens=False)["input_ids"]
    assert plain["token_strs"] is None


@pytest.mark.parametrize("with_tools", [False, True], ids=["messages", "messages+tools"])
def test_tokenize_messages_counts_what_chat_completions_feeds_the_model(
    server, client, hf_tok, with_tools
):
    extra = {"tools": TOOLS} if with_tools else {}
    r = _post(server, "/tokenize", {"model": MODEL, "messages": MESSAGES, **extra})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = hf_tok.apply_chat_template(
        MESSAGES, tools=TOOLS if with_tools else None, add_generation_prompt=True, tokenize=True
    )
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert body["tokens"] == expected and body["count"] == len(expected)
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0, **extra
    )
    assert chat.usage.prompt_tokens == body["count"]
    no_prompt = _post(
        server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False, **extra}
    ).json()
    assert no_prompt["count"] < body["count"]
    assert body["tokens"][: no_prompt["count"]] == no_prompt["tokens"]


def test_tokenize_enable_thinking_null_is_unset_and_false_differs(server):
    """``enable_thinking: null`` renders as if absent; ``false`` renders the empty think block."""
    ids = {}
    for label, kwargs in (("absent", None), ("null", {"enable_thinking": None})):
        body = {"messages": MESSAGES, **({"chat_template_kwargs": kwargs} if kwargs else {})}
        r = _post(server, "/tokenize", body)
        assert r.status_code == 200, r.text
        ids[label] = r.json()["tokens"]
    off = _post(
        server,
        "/tokenize",
        {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}},
    ).json()["tokens"]
    assert ids["null"] == ids["absent"] != off


def test_detokenize_round_trip(server, hf_tok):
    ids = hf_tok("Hello <|im_end|> wörld 😀")["input_ids"]
    r = _post(server, "/detokenize", {"model": MODEL, "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": hf_tok.decode(ids, skip_special_tokens=False)}
    assert _post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/tokenize", {"prompt": "x", "model": "gpt-4o"}, 404, "model"),
        ("/tokenize", {"messages": [], "model": MODEL}, 400, "messages"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        (
            "/tokenize",
            {"messages": MESSAGES, "continue_final_message": True},
            400,
            "continue_final_message",
        ),
        ("/tokenize", "not an object", 400, None),
        ("/tokenize", {"messages": MESSAGES, "tool_choice": "bogus"}, 400, "tool_choice"),
        ("/tokenize", {"messages": MESSAGES, "prompt": "x"}, 400, "messages"),
        (
            "/tokenize",
            {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}] * 2},
            400,
            "tools",
        ),
        ("/tokenize", {"messages": MESSAGES, "tool_choice": "required"}, 400, "tool_choice"),
        (
            "/tokenize",
            {
                "messages": MESSAGES,
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "not_a_tool"}},
            },
            400,
            "tool_choice.function.name",
        ),
        (
            "/tokenize",
            {"messages": MESSAGES, "tool_choice": {"type": "function"}},
            400,
            "tool_choice",
        ),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
        ("/tokenize", {"prompt": "x", "return_token_strs": 1}, 400, "return_token_strs"),
        (
            "/tokenize",
            {"messages": MESSAGES, "return_token_strs": "true"},
            400,
            "return_token_strs",
        ),
        (
            "/tokenize",
            {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": 0}},
            400,
            "chat_template_kwargs",
        ),
        ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
        ("/detokenize", {"tokens": [151936]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/detokenize", {"tokens": [True]}, 400, "tokens.0"),  # a boolean is not an id
        ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model"),
    ],
)
def test_tokenize_errors_are_openai_bodies(server, path, body, status, param):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]


def test_tokenize_rejects_a_body_that_is_not_json(server):
    r = httpx.post(server.base_url + "/tokenize", content=b"{nope", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "json_invalid"


CONTINUED = MESSAGES + [{"role": "assistant", "content": "My favourite colour is "}]


def test_continue_final_message_matches_transformers(server, client, hf_tok):
    """``continue_final_message``: the conversation rendered open at the final message, as
    transformers' ``apply_chat_template(continue_final_message=True)`` renders it (its trailing
    space kept); chat completions generate from exactly those ids."""
    rendered = hf_tok.apply_chat_template(
        CONTINUED, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    expected = hf_tok(rendered, add_special_tokens=False)["input_ids"]
    assert hf_tok.decode(expected).endswith("My favourite colour is ")
    body = {"messages": CONTINUED, "add_generation_prompt": False, "continue_final_message": True}
    r = _post(server, "/tokenize", body)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == expected
    chat = client.chat.completions.create(
        model=MODEL,
        messages=CONTINUED,
        max_tokens=5,
        temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    assert chat.usage.prompt_tokens == len(expected)
    text = client.completions.create(model=MODEL, prompt=expected, max_tokens=5, temperature=0)
    assert chat.choices[0].message.content == text.choices[0].text


@pytest.mark.parametrize(
    "body,says",
    [
        ({"messages": CONTINUED, "continue_final_message": True}, "add_generation_prompt false"),
        (
            {
                "messages": MESSAGES + [{"role": "assistant", "content": "  "}],
                "add_generation_prompt": False,
                "continue_final_message": True,
            },
            "with text",
        ),
    ],
)
@pytest.mark.parametrize("path", ["/tokenize", "/v1/chat/completions"])
def test_continue_final_message_refusals(server, path, body, says):
    r = _post(server, path, {"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "continue_final_message" and says in err["message"], err


def test_add_special_tokens_applies_the_post_processor(server, client, hf_tok):
    """vLLM's ``add_special_tokens`` on completions and chat: the tokenizer's post-processor,
    which for Qwen adds nothing, so both values give transformers' ids."""
    for flag in (True, False):
        out = client.completions.create(
            model=MODEL, prompt="Hello there", max_tokens=1, extra_body={"add_special_tokens": flag}
        )
        assert out.usage.prompt_tokens == len(
            hf_tok("Hello there", add_special_tokens=flag)["input_ids"]
        )
        chat = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=1, extra_body={"add_special_tokens": flag}
        )
        rendered = hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        assert chat.usage.prompt_tokens == len(
            hf_tok(rendered, add_special_tokens=flag)["input_ids"]
        )


def test_response_shapes_carry_openai_nulls(server):
    """``refusal`` and ``system_fingerprint`` are present (null) as OpenAI sends them, and every
    chat chunk's choice has ``logprobs`` (null without log-probabilities)."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3}
    r = _post(server, "/v1/chat/completions", body).json()
    assert r["system_fingerprint"] is None and r["choices"][0]["message"]["refusal"] is None
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}).json()
    assert "system_fingerprint" in r and r["system_fingerprint"] is None
    with httpx.stream(
        "POST", server.base_url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(e) for e in events]
    assert chunks and all(c["system_fingerprint"] is None for c in chunks)
    assert all("logprobs" in ch and ch["logprobs"] is None for c in chunks for ch in c["choices"])


@pytest.mark.parametrize(
    "field,value,ok",
    [
        ("chat_template", None, True),
        ("mm_processor_kwargs", None, True),
        ("chat_template", "{{ messages }}", False),
        ("mm_processor_kwargs", {"size": 1}, False),
        ("frobnicate", 1, False),
    ],
)
def test_tokenize_chat_fields_of_vllm(server, field, value, ok):
    """vLLM's /tokenize chat fields this server does not apply are accepted as null only; a
    value, like an unknown field, is a 400 naming it."""
    r = _post(server, "/tokenize", {"messages": MESSAGES, field: value})
    if ok:
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text
