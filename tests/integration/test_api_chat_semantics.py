"""Chat semantics over real HTTP: the checkpoint's chat template, chat_template_kwargs, the Qwen3
reasoning split, tool calls (streamed and not), tool messages as input, and UTF-8-safe streaming.

Why the sampler is scripted: the embedded model has random weights, so it never writes a
``<think>`` or ``<tool_call>`` block by itself, and a logit bias can force one token but not a
sequence. This module therefore runs the real server (``server.factory.build_context`` +
``server.app.create_app`` under uvicorn, in a thread of this process, on a real port) and wraps
the engine's sampler: a request whose prompt contains a registered marker gets a scripted token
sequence (the real tokenizer's encoding of a text, then EOS) in place of the sampled tokens.
Everything else is real: template rendering, the engine loop and model forward passes, the
detokenizer, stop strings, the reasoning and tool parsers, response shapes and SSE streaming.
Requests without a marker are sampled by the real sampler.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import httpx
import openai
import pytest
import uvicorn

from engine.loader.embedded import ensure_embedded_checkpoint
from engine.worker.sampler import DeviceSamples
from server.__main__ import build_parser
from server.app import create_app
from server.chat import render_prompt
from server.factory import build_context
from server.protocol import ChatCompletionRequest
from tests.serverproc import free_port

MODEL = "qwen3-embedded"
EOS = 151645
FFFD = "\ufffd"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
            "required": ["city"],
        },
    },
}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


class ScriptedSampler:
    """Wraps the engine's Sampler: requests whose prompt contains a registered marker get the
    marker's scripted tokens, then EOS; all others get the real sampler's tokens."""

    def __init__(self, real, tokenizer):
        self.real, self.tokenizer = real, tokenizer
        self.scripts: dict[str, list[int]] = {}
        self._assigned: dict[str, list[int] | None] = {}

    def script(self, marker: str, text: str) -> list[int]:
        ids = self.tokenizer.encode(text)
        self.scripts[marker] = ids
        return ids

    def _script_of(self, req) -> list[int] | None:
        if req.request_id not in self._assigned:
            prompt = self.tokenizer.decode(req.prompt_token_ids, skip_special_tokens=False)
            scripts = list(self.scripts.items())  # a snapshot: the test thread may register more
            self._assigned[req.request_id] = next((ids for m, ids in scripts if m in prompt), None)
        return self._assigned[req.request_id]

    def __call__(self, logits, requests, eos_ids, *grammar) -> DeviceSamples:
        out = self.real(logits, requests, eos_ids, *grammar)
        for row, req in enumerate(requests):
            script = self._script_of(req)
            if script is not None:
                i = len(req.output_token_ids)
                out.token_ids[row] = script[i] if i < len(script) else EOS
        return out


@dataclass
class Live:
    base_url: str
    client: openai.OpenAI
    sampler: ScriptedSampler
    ctx: object


@pytest.fixture(scope="module")
def live():
    ctx = build_context(
        build_parser().parse_args(
            [
                "--max-model-len",
                "2048",
                "--reasoning-parser",
                "qwen3",
                "--num-kv-blocks",
                "256",
                "--device",
                "cpu",
            ]
        )
    )
    runner = ctx.engine.engine.executor
    sampler = ScriptedSampler(runner.sampler, ctx.tokenizer)
    runner.sampler = sampler
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(ctx), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "in-process server did not start"
        time.sleep(0.05)
    base = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        yield Live(base, client, sampler, ctx)
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_embedded_checkpoint())


EXTRA_FIELDS = {
    "chat_template_kwargs",
    "top_k",
    "min_tokens",
    "ignore_eos",
    "include_reasoning",
    "add_generation_prompt",
    "continue_final_message",
}


def chat(live: Live, content: str | list, **kw):
    messages = kw.pop("messages", None) or [{"role": "user", "content": content}]
    extra = {k: kw.pop(k) for k in list(kw) if k in EXTRA_FIELDS}
    return live.client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=kw.pop("max_tokens", 64),
        extra_body=extra or None,
        **kw,
    )


def collect_stream(chunks) -> dict:
    """Per choice index: joined reasoning and content, tool-call deltas, finish reason."""
    out: dict[int, dict] = {}
    for c in chunks:
        assert c.id == chunks[0].id and c.model == MODEL and c.created
        for ch in c.choices:
            o = out.setdefault(
                ch.index, {"reasoning": "", "content": "", "calls": [], "finish": None, "order": []}
            )
            r = getattr(ch.delta, "reasoning_content", None)
            if r:
                o["reasoning"] += r
                o["order"].append("reasoning")
            if ch.delta.content:
                o["content"] += ch.delta.content
                o["order"].append("content")
            if ch.delta.tool_calls:
                o["calls"] += ch.delta.tool_calls
                o["order"].append("tool_calls")
            if ch.finish_reason:
                o["finish"] = ch.finish_reason
    return out


# ---------------------------------------------------------------- chat template
CONVERSATIONS = [
    (
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
        None,
        {},
    ),
    (
        [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        None,
        {"enable_thinking": False},
    ),
    (
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Two "}, {"type": "text", "text": "parts"}],
            }
        ],
        None,
        {},
    ),
    ([{"role": "user", "content": "Weather in Paris?"}], [WEATHER_TOOL], {}),
    (
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": json.dumps({"city": "Paris"}),
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        ],
        [WEATHER_TOOL],
        {"enable_thinking": False},
    ),
    (
        [
            {"role": "user", "content": "1+1?"},
            {"role": "assistant", "content": "2", "reasoning_content": "add"},
            {"role": "user", "content": "2+2?"},
        ],
        None,
        {},
    ),
]


@pytest.mark.parametrize(
    "messages,tools,kwargs",
    CONVERSATIONS,
    ids=["system", "developer-nothink", "text-parts", "tools", "tool-round-trip", "history"],
)
def test_prompt_is_the_checkpoint_template_as_transformers_renders_it(
    live, hf_tokenizer, messages, tools, kwargs
):
    """The server's prompt equals transformers' apply_chat_template on the checkpoint (string and
    token count over HTTP); chat_template_kwargs reach the template; assistant messages with
    tool_calls and content null, and tool messages, are accepted."""
    hf_messages = [
        {**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in messages
    ]
    hf_messages = [
        {**m, "content": "\n".join(p["text"] for p in m["content"])}  # (vLLM's join)
        if isinstance(m.get("content"), list)
        else m
        for m in hf_messages
    ]
    expected = hf_tokenizer.apply_chat_template(
        hf_messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
    )
    body = {
        "model": MODEL,
        "messages": messages,
        "tools": tools,
        "chat_template_kwargs": kwargs or None,
    }
    assert render_prompt(live.ctx.tokenizer, ChatCompletionRequest(**body)) == expected
    extra = {"chat_template_kwargs": kwargs} if kwargs else None
    out = live.client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=tools or openai.NOT_GIVEN,
        max_tokens=1,
        temperature=0,
        extra_body=extra,
    )
    assert out.usage.prompt_tokens == len(
        hf_tokenizer(expected, add_special_tokens=False)["input_ids"]
    )


def test_enable_thinking_false_prefills_an_empty_think_block(live):
    on = chat(live, "Hi", max_tokens=1).usage.prompt_tokens
    off = chat(live, "Hi", max_tokens=1, **NO_THINK).usage.prompt_tokens
    assert off - on == len(live.ctx.tokenizer.encode("<think>\n\n</think>\n\n"))


# ---------------------------------------------------------------- reasoning
def test_reasoning_is_split_from_content(live):
    live.sampler.script(
        "[[think]]", "<think>\nThe user wants 6*7.\nThat is 42.\n</think>\n\nThe answer is 42."
    )
    out = chat(live, "[[think]] what is 6*7?")
    msg = out.choices[0].message
    assert msg.reasoning_content == "The user wants 6*7.\nThat is 42."
    assert msg.content == "The answer is 42." and out.choices[0].finish_reason == "stop"

    got = collect_stream(list(chat(live, "[[think]] what is 6*7?", stream=True)))[0]
    assert got["reasoning"] == msg.reasoning_content and got["content"] == msg.content
    assert got["finish"] == "stop"
    assert got["order"] == sorted(
        got["order"], key=["reasoning", "content"].index
    )  # reasoning first


def test_include_reasoning_false_drops_the_reasoning(live):
    """vLLM's ``include_reasoning``: false returns the answer without ``reasoning_content``,
    complete and streamed (no reasoning deltas, no empty chunks in their place)."""
    live.sampler.script("[[think2]]", "<think>\nFirst, think.\n</think>\n\nThe answer.")
    out = chat(live, "[[think2]] q", include_reasoning=False)
    msg = out.choices[0].message
    assert msg.content == "The answer." and getattr(msg, "reasoning_content", None) is None
    chunks = list(chat(live, "[[think2]] q", stream=True, include_reasoning=False))
    got = collect_stream(chunks)[0]
    assert got["content"] == "The answer." and got["reasoning"] == ""
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert all(d.content or d.role or d.tool_calls for d in deltas[:-1]), deltas
    with_it = chat(live, "[[think2]] q", include_reasoning=True).choices[0].message
    assert with_it.reasoning_content == "First, think." and with_it.content == "The answer."


def test_continued_reasoning_is_reasoning(live):
    """A continued final message still inside its ``<think>``: what the model adds up to its
    ``</think>`` is reasoning, the rest the answer; one past its reasoning continues the
    answer (complete and streamed)."""
    live.sampler.script("[[cont]]", " see.\n</think>\n\nDone.")
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    inside = [
        {"role": "user", "content": "[[cont]] q"},
        {"role": "assistant", "content": "<think>\nLet me"},
    ]
    msg = chat(live, "", messages=inside, **cont).choices[0].message
    assert (msg.reasoning_content, msg.content) == (" see.", "Done.")
    got = collect_stream(list(chat(live, "", messages=inside, stream=True, **cont)))[0]
    assert (got["reasoning"], got["content"]) == (" see.", "Done.")
    live.sampler.script("[[cont2]]", " and more.")
    past = [
        {"role": "user", "content": "[[cont2]] q"},
        {"role": "assistant", "content": "The <think> tag is"},
    ]
    msg = chat(live, "", messages=past, **cont).choices[0].message
    assert msg.content == " and more." and getattr(msg, "reasoning_content", None) is None


def test_reasoning_cut_by_max_tokens_is_all_reasoning(live):
    ids = live.sampler.script(
        "[[long-think]]", "<think>\nstep one, step two, step three, step four"
    )
    out = chat(live, "[[long-think]] go", max_tokens=6)
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].message.reasoning_content == live.ctx.tokenizer.decode(ids[2:6])
    assert out.choices[0].message.content in (None, "")
    got = collect_stream(list(chat(live, "[[long-think]] go", max_tokens=6, stream=True)))[0]
    assert got["reasoning"] == out.choices[0].message.reasoning_content and got["content"] == ""


def test_thinking_off_keeps_the_answer_in_content(live):
    live.sampler.script("[[plain]]", "Just the answer, no tags.")
    out = chat(live, "[[plain]] hi", **NO_THINK)
    assert out.choices[0].message.content == "Just the answer, no tags."
    assert getattr(out.choices[0].message, "reasoning_content", None) is None
    got = collect_stream(list(chat(live, "[[plain]] hi", stream=True, **NO_THINK)))[0]
    assert got["content"] == "Just the answer, no tags." and got["reasoning"] == ""

    # unscripted (the real model's tokens): content is exactly the raw completion of the same prompt
    messages = [{"role": "user", "content": "Say something."}]
    prompt = live.ctx.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, enable_thinking=False
    )
    raw = (
        live.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        .choices[0]
        .text
    )
    out = chat(live, "", messages=messages, max_tokens=12, **NO_THINK)
    assert out.choices[0].message.content == raw


# ---------------------------------------------------------------- tool calls
def test_tool_call_becomes_tool_calls(live):
    live.sampler.script(
        "[[tool]]",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "°C"}}\n</tool_call>',
    )
    out = chat(live, "[[tool]] weather in Paris?", tools=[WEATHER_TOOL], **NO_THINK)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (
        call.type == "function"
        and call.id.startswith("call_")
        and call.function.name == "get_weather"
    )
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "°C"}

    got = collect_stream(
        list(
            chat(live, "[[tool]] weather in Paris?", tools=[WEATHER_TOOL], stream=True, **NO_THINK)
        )
    )[0]
    assert got["finish"] == "tool_calls" and got["content"] == ""
    (delta,) = got["calls"]
    assert delta.index == 0 and delta.id.startswith("call_") and delta.type == "function"
    assert delta.function.name == "get_weather"
    assert json.loads(delta.function.arguments) == {"city": "Paris", "unit": "°C"}


def test_reasoning_text_and_two_tool_calls(live):
    live.sampler.script(
        "[[two-tools]]",
        (
            "<think>\nI need both cities.\n</think>\n\nChecking both.\n"
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"}}\n</tool_call>'
        ),
    )
    out = chat(live, "[[two-tools]] Paris and Tokyo?", tools=[WEATHER_TOOL], tool_choice="auto")
    msg = out.choices[0].message
    assert msg.reasoning_content == "I need both cities." and msg.content == "Checking both."
    assert [json.loads(c.function.arguments)["city"] for c in msg.tool_calls] == ["Paris", "東京"]
    assert len({c.id for c in msg.tool_calls}) == 2 and out.choices[0].finish_reason == "tool_calls"

    chunks = list(
        chat(live, "[[two-tools]] Paris and Tokyo?", tools=[WEATHER_TOOL], stream=True, n=2)
    )
    got = collect_stream(chunks)
    assert sorted(got) == [0, 1]
    for g in got.values():  # each choice has its own parsers
        assert g["reasoning"] == "I need both cities." and g["content"] == "Checking both."
        assert [c.index for c in g["calls"]] == [0, 1] and g["finish"] == "tool_calls"
        assert [json.loads(c.function.arguments)["city"] for c in g["calls"]] == ["Paris", "東京"]


def test_tool_choice_none_and_malformed_calls_stay_text(live):
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    live.sampler.script("[[tool-none]]", text)
    with_tools = chat(
        live, "[[tool-none]] hi", tools=[WEATHER_TOOL], max_tokens=1, **NO_THINK
    ).usage.prompt_tokens
    out = chat(live, "[[tool-none]] hi", tools=[WEATHER_TOOL], tool_choice="none", **NO_THINK)
    assert out.usage.prompt_tokens < with_tools  # tools are not rendered into the prompt
    assert out.choices[0].message.content == text and not out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "stop"

    bad = '<tool_call>\n{"name": get_weather, "arguments": }\n</tool_call>'
    live.sampler.script("[[tool-bad]]", bad)
    out = chat(live, "[[tool-bad]] hi", tools=[WEATHER_TOOL], **NO_THINK)
    assert out.choices[0].message.content == bad and not out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "stop"
    got = collect_stream(
        list(chat(live, "[[tool-bad]] hi", tools=[WEATHER_TOOL], stream=True, **NO_THINK))
    )[0]
    assert got["content"] == bad and got["calls"] == [] and got["finish"] == "stop"


def test_tool_result_round_trip(live):
    live.sampler.script("[[after-tool]]", "It is sunny in Paris.")
    messages = [
        {"role": "user", "content": "[[after-tool]] Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_9",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_9", "content": "sunny"},
    ]
    out = chat(live, "", messages=messages, tools=[WEATHER_TOOL], **NO_THINK)
    assert (
        out.choices[0].message.content == "It is sunny in Paris."
        and out.choices[0].finish_reason == "stop"
    )


# ---------------------------------------------------------------- UTF-8 and stop strings
MULTIBYTE = "你好，世界！🎉😀👍🏽 Ünïcödé 𝔘𝔫𝔦 done"


def test_streamed_deltas_never_contain_partial_characters(live):
    ids = live.sampler.script("[[utf8]]", MULTIBYTE)
    tok = live.ctx.tokenizer
    assert sum(FFFD in tok.decode([i]) for i in ids) >= 3  # several tokens hold part of a character

    out = chat(live, "[[utf8]]", **NO_THINK)
    assert out.choices[0].message.content == MULTIBYTE
    deltas = [
        c.choices[0].delta.content
        for c in chat(live, "[[utf8]]", stream=True, **NO_THINK)
        if c.choices and c.choices[0].delta.content
    ]
    assert "".join(deltas) == MULTIBYTE and not any(FFFD in d for d in deltas)
    assert len(deltas) > 5

    with httpx.stream(
        "POST",
        live.base_url + "/v1/completions",
        timeout=120,
        json={
            "model": MODEL,
            "prompt": "[[utf8]]",
            "max_tokens": 64,
            "temperature": 0,
            "stream": True,
        },
    ) as r:
        texts = [
            json.loads(line[6:])["choices"][0]["text"]
            for line in r.iter_lines()
            if line.startswith("data: {")
        ]
    assert "".join(texts) == MULTIBYTE and not any(FFFD in t for t in texts)


@pytest.mark.parametrize("stop", ["🎉😀", "界！", "👍🏽 Ü", "ödé 𝔘"])
def test_stop_strings_inside_multibyte_tokens(live, stop):
    live.sampler.script("[[utf8]]", MULTIBYTE)
    expected = MULTIBYTE[: MULTIBYTE.index(stop)]
    out = chat(live, "[[utf8]]", stop=[stop], **NO_THINK)
    assert out.choices[0].message.content == expected and out.choices[0].finish_reason == "stop"
    deltas = [
        c.choices[0].delta.content or ""
        for c in chat(live, "[[utf8]]", stop=stop, stream=True, **NO_THINK)
        if c.choices
    ]
    assert "".join(deltas) == expected and not any(FFFD in d for d in deltas)


def test_request_path_makes_no_thread_pool_hop(live, monkeypatch):
    """FastAPI runs plain-function dependencies and endpoints in its thread pool: a thread hop
    (and a wait for the GIL) before every request reaches the handler. None is on our path."""
    import fastapi.dependencies.utils
    import fastapi.routing

    hops = []
    for module in (fastapi.dependencies.utils, fastapi.routing):
        original = module.run_in_threadpool

        async def counting(func, *args, _original=original, **kwargs):
            hops.append(getattr(func, "__name__", repr(func)))
            return await _original(func, *args, **kwargs)

        monkeypatch.setattr(module, "run_in_threadpool", counting)
    chat(live, "Hi", max_tokens=1)
    with live.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=True
    ) as stream:
        assert list(stream)
    live.client.models.list()
    assert hops == []
