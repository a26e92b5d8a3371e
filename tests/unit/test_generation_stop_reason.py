"""vLLM's ``stop_reason`` as :class:`server.generation.Generation` reports it, on a fake engine.

The engine is replaced by scripted outputs (ids per step, the finish on the last), so the
cases vLLM's ``check_stop`` distinguishes can be set up exactly: several ids in one output, a
stop string and a stop token in one step, the tokenizer's own EOS listed in ``stop_token_ids``
(null, unless ``ignore_eos``), an EOS id that only generation_config adds (its id), and a stop
string completed by the text held back until the end (the last token ends inside a UTF-8
character). End-to-end checks over HTTP are in tests/integration/test_api_sampling.py.
"""

from __future__ import annotations

import asyncio
import types

import pytest

from engine.core.request import FinishReason, SamplingParams
from server.generation import Generation

STOP, LENGTH = FinishReason.STOP, FinishReason.LENGTH
PRIMARY_EOS, EXTRA_EOS = 9, 8  # the tokenizer's eos_token; one generation_config adds
PIECES = {1: b"x", 2: b"a", 3: b"b", 4: b"c", 5: b"b\xc3", 6: b"\xa9", 7: b"q", 8: b"", 9: b""}


class FakeTokenizer:
    """Byte pieces per id; no DecodeStream (the detokenizer decodes windows)."""

    eos_token_id = PRIMARY_EOS

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")

    def decode_stream(self, prefill_ids=(), skip_special_tokens=True):
        return None


class FakeEngine:
    """Answers every request with the scripted outputs."""

    def __init__(self, outputs):
        self.outputs = outputs
        self.limits = types.SimpleNamespace(
            eos_token_ids=frozenset({PRIMARY_EOS, EXTRA_EOS}), validate=lambda ids: None
        )
        self.aborted = []

    def add_request(self, request_id, prompt_ids, params):
        outputs = self.outputs

        class Stream:
            async def __aiter__(self):
                for o in outputs:
                    yield o

        stream = Stream()
        stream.request_id = request_id
        return stream

    def abort(self, request_id):
        self.aborted.append(request_id)


def out(ids, finish=None):
    return types.SimpleNamespace(
        new_token_ids=ids,
        logprobs=[],
        prompt_logprobs=None,
        error=None,
        finished=finish is not None,
        finish_reason=finish,
    )


def run(outputs, **params):
    """(text, finish_reason, stop_reason) of the one choice, collected and streamed."""

    async def go():
        gen = Generation(FakeEngine(outputs), FakeTokenizer(), "r", [1], SamplingParams(**params))
        collected = (await gen.collect())[0]
        gen = Generation(FakeEngine(outputs), FakeTokenizer(), "r", [1], SamplingParams(**params))
        events = [ev async for ev in gen.events()]
        streamed = (
            "".join(ev.text for ev in events),
            events[-1].finish_reason,
            events[-1].stop_reason,
        )
        return (collected.text, collected.finish_reason, collected.stop_reason), streamed

    collected, streamed = asyncio.run(go())
    assert collected == streamed
    return collected


@pytest.mark.parametrize(
    "outputs,params,expected",
    [
        # several ids in one output, the last a stop token: its id
        ([out([1, 2, 7], STOP)], dict(stop_token_ids=[7]), ("xa", "stop", 7)),
        # a stop string and a stop token in the same step: the string (it comes first)
        ([out([2, 3, 4, 7], STOP)], dict(stop=["ab"], stop_token_ids=[7]), ("", "stop", "ab")),
        # the tokenizer's own EOS: null, also when listed in stop_token_ids
        ([out([1, PRIMARY_EOS], STOP)], dict(), ("x", "stop", None)),
        ([out([1, PRIMARY_EOS], STOP)], dict(stop_token_ids=[PRIMARY_EOS]), ("x", "stop", None)),
        # ... but with ignore_eos a listed EOS is a plain stop token: its id
        (
            [out([1]), out([PRIMARY_EOS], STOP)],
            dict(stop_token_ids=[PRIMARY_EOS], ignore_eos=True),
            ("x", "stop", PRIMARY_EOS),
        ),
        # an EOS id generation_config adds: vLLM makes it a stop token id, reported
        ([out([1, EXTRA_EOS], STOP)], dict(), ("x", "stop", EXTRA_EOS)),
        # the stop token's text kept: still its id
        (
            [out([1, 7], STOP)],
            dict(stop_token_ids=[7], include_stop_str_in_output=True),
            ("xq", "stop", 7),
        ),
        # a length finish: null, whatever the last id is
        ([out([1, 7], LENGTH)], dict(stop_token_ids=[8]), ("xq", "length", None)),
        # "ab" completes only when the held-back bytes are flushed at the end (id 5 ends inside
        # a UTF-8 character): cut there, reported as a stop at "ab"
        ([out([1]), out([2]), out([5], LENGTH)], dict(stop=["ab"]), ("x", "stop", "ab")),
        # ... and a character completed within the output is no stop string
        ([out([1]), out([5]), out([6], LENGTH)], dict(stop=["bx"]), ("xb\u00e9", "length", None)),
    ],
)
def test_stop_reason(outputs, params, expected):
    assert run(outputs, **params) == expected
