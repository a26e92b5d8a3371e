"""The real Qwen2.5-Coder-0.5B-Instruct checkpoint (built by `make real-checkpoint`).

Greedy token ids of the engine equal transformers' `generate`, and the server answers a coding
question with code that runs. Skipped when the checkpoint is absent.
"""

from __future__ import annotations

import re

import openai
import pytest

from engine.core.config import EngineConfig
from engine.core.request import SamplingParams
from engine.frontend.tokenizer import Tokenizer
from engine.worker.build import build_engine
from tests.integration.real_checkpoint_reference import (
    CHAT_PROMPTS,
    REAL_CHECKPOINT_DIR,
    real_checkpoint_available,
    transformers_greedy_ids,
)
from tests.serverproc import ServerProcess

pytestmark = [
    pytest.mark.real_checkpoint,
    pytest.mark.skipif(not real_checkpoint_available(), reason="run `make real-checkpoint` first"),
]

MAX_NEW = 24


@pytest.fixture(scope="module")
def real_server():
    srv = ServerProcess("--model", str(REAL_CHECKPOINT_DIR), "--max-model-len", "2048").wait_ready(
        300
    )
    yield srv
    srv.stop()


def test_engine_greedy_ids_equal_transformers():
    tok = Tokenizer(REAL_CHECKPOINT_DIR)
    engine = build_engine(
        EngineConfig(model=str(REAL_CHECKPOINT_DIR), max_model_len=2048),
        eos_token_ids=tok.eos_token_ids,
    )
    prompts = [
        tok.encode(tok.apply_chat_template(m, add_generation_prompt=True)) for m in CHAT_PROMPTS
    ]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    for messages, out in zip(CHAT_PROMPTS, outs):
        expected = transformers_greedy_ids(REAL_CHECKPOINT_DIR, messages, max_new_tokens=MAX_NEW)
        assert out == expected, (tok.decode(out), tok.decode(expected))


def test_server_answers_with_working_code(real_server):
    client = openai.OpenAI(
        base_url=real_server.base_url + "/v1", api_key="unused", timeout=600, max_retries=0
    )
    r = client.chat.completions.create(
        model=REAL_CHECKPOINT_DIR.name,
        messages=CHAT_PROMPTS[0],
        temperature=0,
        max_tokens=80,
        extra_body={"repetition_penalty": 1.0},
    )
    text = r.choices[0].message.content
    print("\n--- transcript ---\nuser:", CHAT_PROMPTS[0][0]["content"], "\nassistant:", text)
    code = re.search(r"```(?:python)?\n(.*?)```", text, re.S)
    assert code, text
    namespace: dict = {}
    exec(code.group(1), namespace)  # noqa: S102 - the model's answer, run in a scratch namespace
    fn = next(v for k, v in namespace.items() if callable(v) and not k.startswith("__"))
    assert fn(7) == 49 and fn(-3) == 9

    # streamed greedy text equals the non-streamed text
    stream = client.chat.completions.create(
        model=REAL_CHECKPOINT_DIR.name,
        messages=CHAT_PROMPTS[0],
        temperature=0,
        max_tokens=80,
        stream=True,
        extra_body={"repetition_penalty": 1.0},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_tool_loop_with_tool_choice_required(real_server):
    """Qwen2.5-Coder writes its calls as fenced JSON when left alone; with ``tool_choice:
    "required"`` the grammar makes it write the checkpoint's own ``<tool_call>`` block, which
    comes back as ``tool_calls``; the follow-up turn, given the tool result, answers from it."""
    import json

    client = openai.OpenAI(
        base_url=real_server.base_url + "/v1", api_key="unused", timeout=600, max_retries=0
    )
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_temperature",
                "description": "Current temperature of a city, in Celsius.",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    messages = [{"role": "user", "content": "What is the temperature in Lisbon right now?"}]
    r = client.chat.completions.create(
        model=REAL_CHECKPOINT_DIR.name,
        messages=messages,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,  # greedy, the model would chain calls to the token limit
        temperature=0,
        max_tokens=80,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_temperature" and args["city"].lower().startswith("lisb")
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 31}'},
        # the 0.5B model repeats its call after a bare tool result; asked again, it answers
        {
            "role": "user",
            "content": "Thanks. So what is the temperature there? Answer in one sentence.",
        },
    ]
    r2 = client.chat.completions.create(
        model=REAL_CHECKPOINT_DIR.name, messages=messages, tools=tools, temperature=0, max_tokens=60
    )
    answer = r2.choices[0].message.content or ""
    print("\n--- tool loop ---\ncall:", call.function.arguments, "\nanswer:", answer)
    assert "31" in answer
