"""The embedded Qwen3-format chat template and the sandboxed renderer (frontend tokenizer)."""

from __future__ import annotations

import json
from datetime import datetime

import pytest
from jinja2.exceptions import SecurityError, TemplateError

from engine.frontend.tokenizer import ChatTemplateError, Tokenizer
from engine.loader.embedded import ensure_embedded_checkpoint


@pytest.fixture(scope="module")
def ckpt():
    return ensure_embedded_checkpoint()


@pytest.fixture(scope="module")
def tok(ckpt) -> Tokenizer:
    return Tokenizer(ckpt)


@pytest.fixture(scope="module")
def hf_tok(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city — «météo»",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
TOOLS_BLOCK = (
    "# Tools\n\nThese functions are available to help with the user's request. Their signatures "
    "are listed inside <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(WEATHER_TOOL, ensure_ascii=False)
    + "\n</tools>\n\nTo call a function, reply with a JSON object holding its name and arguments "
    "inside <tool_call></tool_call> XML tags, one block per call:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def U(text):
    return {"role": "user", "content": text}


def A(text, **kw):
    return {"role": "assistant", "content": text, **kw}


def test_user_turn_and_generation_prompt(tok):
    assert (
        tok.apply_chat_template([U("Hi")])
        == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (
        tok.apply_chat_template([U("Hi")], add_generation_prompt=False)
        == "<|im_start|>user\nHi<|im_end|>\n"
    )


def test_system_and_enable_thinking_false(tok):
    out = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, U("Hi")], enable_thinking=False
    )
    assert out == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert tok.apply_chat_template([U("Hi")], enable_thinking=True).endswith("assistant\n")


def test_content_parts(tok):
    msg = {
        "role": "user",
        "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}],
    }
    assert (
        tok.apply_chat_template([msg], add_generation_prompt=False)
        == "<|im_start|>user\nHello there<|im_end|>\n"
    )
    with pytest.raises(ChatTemplateError, match="Only text content parts"):
        tok.apply_chat_template(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
        )


def test_history_drops_thinking(tok):
    msgs = [
        U("1+1?"),
        A("<think>\nadd them\n</think>\n\n2"),
        U("2+2?"),
        A("4", reasoning_content="easy"),
    ]
    out = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert out == (
        "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\neasy\n</think>\n\n4<|im_end|>\n"
    )


def test_tools_in_system_turn(tok):
    out = tok.apply_chat_template(
        [{"role": "system", "content": "Sys."}, U("Weather?")], tools=[WEATHER_TOOL]
    )
    assert out == (
        "<|im_start|>system\nSys.\n\n" + TOOLS_BLOCK + "<|im_end|>\n"
        "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n"
    )
    out = tok.apply_chat_template([U("Weather?")], tools=[WEATHER_TOOL])
    assert out.startswith("<|im_start|>system\n# Tools\n\n") and "«météo»" in out


def test_tool_calls_and_tool_responses(tok):
    msgs = [
        U("Weather in Paris and Rome?"),
        A(
            None,
            tool_calls=[
                CALL,
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
                },
            ],
        ),
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "content": [{"type": "text", "text": "rainy"}]},
        A("Sunny in Paris, rainy in Rome."),
    ]
    out = tok.apply_chat_template(msgs, tools=[WEATHER_TOOL], add_generation_prompt=False)
    assert out == (
        "<|im_start|>system\n" + TOOLS_BLOCK + "<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrainy\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nSunny in Paris, rainy in Rome.<|im_end|>\n"
    )


def test_tool_call_after_content_and_reasoning_in_current_round(tok):
    msgs = [
        U("Paris?"),
        A("Let me check.", tool_calls=[CALL], reasoning_content="use the tool"),
        {"role": "tool", "content": "sunny"},
    ]
    out = tok.apply_chat_template(msgs)
    assert out == (
        "<|im_start|>user\nParis?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nuse the tool\n</think>\n\nLet me check.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_unknown_role_is_an_error(tok):
    with pytest.raises(ChatTemplateError, match="Unsupported message role: wizard"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])


CONVERSATIONS = [
    ([U("Hi")], None, {}),
    (
        [{"role": "system", "content": "S"}, U("Hi"), A("Hello"), U("Bye")],
        None,
        {"enable_thinking": False},
    ),
    ([U("q"), A("<think>r</think>a"), U("q2")], None, {}),
    (
        [
            U("q"),
            A("a", reasoning="r via the 'reasoning' field"),
            {"role": "system", "content": "late"},
        ],
        None,
        {"add_generation_prompt": False},
    ),
    (
        [
            {"role": "system", "content": [{"type": "text", "text": "S"}]},
            U("Weather?"),
            A(None, tool_calls=[CALL]),
            {"role": "tool", "content": "sunny"},
            {"role": "tool", "content": "warm"},
        ],
        [WEATHER_TOOL],
        {},
    ),
    (
        [
            U("x"),
            A("y", tool_calls=[CALL], reasoning_content="think"),
            {"role": "tool", "content": "<b>&</b>"},
            A("done", reasoning_content="ok"),
        ],
        [WEATHER_TOOL],
        {"add_generation_prompt": False},
    ),
    ([U("<tool_response>fake</tool_response>")], None, {}),
]


@pytest.mark.parametrize("messages,tools,kwargs", CONVERSATIONS)
def test_same_as_transformers(tok, hf_tok, messages, tools, kwargs):
    kwargs = {"add_generation_prompt": True, **kwargs}
    ours = tok.apply_chat_template(messages, tools=tools, **kwargs)
    theirs = hf_tok.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
    assert ours == theirs


# ------------------------------------------------------------------ renderer


def _with_template(tmp_path, ckpt, template) -> Tokenizer:
    (tmp_path / "tokenizer.json").symlink_to(ckpt / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": template, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
        )
    )
    return Tokenizer(tmp_path)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{% set x = [] %}{{ x.append(1) }}",
        "{% set ns = namespace() %}{% set ns._secret = 1 %}",
    ],
)
def test_sandbox_violations_are_wrapped(tmp_path, ckpt, template):
    t = _with_template(tmp_path, ckpt, template)
    with pytest.raises(ChatTemplateError) as info:
        t.apply_chat_template([U("x")])
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value.__cause__, SecurityError)


def test_raise_exception_and_syntax_error(tmp_path, ckpt):
    t = _with_template(tmp_path, ckpt, "{{ raise_exception('no ' + messages[0].role) }}")
    with pytest.raises(ChatTemplateError, match="no user") as info:
        t.apply_chat_template([U("x")])
    assert isinstance(info.value.__cause__, TemplateError)
    (tmp_path / "broken").mkdir()
    t2 = _with_template(tmp_path / "broken", ckpt, "{% if %}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        t2.apply_chat_template([U("x")])


def test_reserved_template_kwargs_rejected(tok):
    with pytest.raises(ChatTemplateError, match="documents"):
        tok.apply_chat_template([U("x")], documents=[])


def test_helpers_and_variables(tmp_path, ckpt, hf_tok):
    template = (
        "{{ data | tojson }}|{{ data | tojson(indent=2) }}|{{ eos_token }}|{{ pad_token }}|"
        "{{ bos_token is defined }}|{{ strftime_now('%Y') }}|{{ dict(a=1) | tojson }}|"
        "{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}|"
        "{% generation %}{{ messages[0].content }}{% endgeneration %}|{{ add_generation_prompt }}"
    )
    t = _with_template(tmp_path, ckpt, template)
    data = {"k": "é <b>&'\"", "n": [1, 2.5, None, True]}
    out = t.apply_chat_template([U("m")], data=data)
    assert out == "|".join(
        [
            json.dumps(data, ensure_ascii=False),
            json.dumps(data, ensure_ascii=False, indent=2),
            "<|im_end|>",
            "<|endoftext|>",
            "False",
            str(datetime.now().year),
            '{"a": 1}',
            "01",
            "m",
            "True",
        ]
    )
    assert out == hf_tok.apply_chat_template(
        [U("m")], chat_template=template, data=data, tokenize=False, add_generation_prompt=True
    )


@pytest.mark.parametrize(
    "n, tools, body_bytes, inline",
    [
        (2, 0, 0, True),
        (64, 0, 0, True),
        (65, 0, 0, False),
        (3000, 0, 0, False),
        (2, 0, 65536, True),
        (2, 0, 65537, False),  # a large body: one long message, a tool's big schema
        (60, 5, 0, False),  # tools count with the messages where they are rendered
    ],
)
def test_long_conversations_render_off_the_event_loop(tok, n, tools, body_bytes, inline):
    """A conversation of more than RENDER_INLINE_ITEMS messages and rendered tools, or a request
    body over RENDER_INLINE_BYTES, renders on the server's template thread (a 60,000-message
    body held the event loop, /health included, for over a second), a small one inline; both
    give render_prompt's text, and a template error is the same 400 either way."""
    import asyncio
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from server.chat import render_prompt, render_prompt_async
    from server.errors import APIError
    from server.protocol import ChatCompletionRequest

    roles = ("user", "assistant")
    req = ChatCompletionRequest(
        model="m",
        messages=[{"role": roles[i % 2], "content": f"m{i}"} for i in range(n - 1)]
        + [{"role": "user", "content": "last"}],
        tools=[WEATHER_TOOL | {"function": {"name": f"f{i}"}} for i in range(tools)] or None,
    )
    threads = []
    render = tok.apply_chat_template

    def spy(*args, **kwargs):
        threads.append(threading.current_thread())
        return render(*args, **kwargs)

    pool = ThreadPoolExecutor(1, thread_name_prefix="chat-template")

    async def main(request):
        return threading.current_thread(), await render_prompt_async(tok, request, pool, body_bytes)

    tok.apply_chat_template = spy
    try:
        loop_thread, text = asyncio.run(main(req))
        assert (threads[0] is loop_thread) == inline
        assert threads[0].name.startswith("chat-template") != inline
        if tools:  # with tool_choice "none" the tools are not rendered, and not counted
            threads.clear()
            asyncio.run(main(req.model_copy(update={"tool_choice": "none"})))
            assert threads[0] is loop_thread  # 60 messages: inline
        bad = req.model_copy(update={"chat_template_kwargs": {"messages": []}})
        with pytest.raises(APIError) as exc:
            asyncio.run(main(bad))
        assert exc.value.param == "chat_template_kwargs"
    finally:
        del tok.apply_chat_template
        pool.shutdown()
    assert text == render_prompt(tok, req)
