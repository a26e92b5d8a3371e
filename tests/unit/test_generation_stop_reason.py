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
            eos_token_ids=frozenset({PRIMARY_EOS, EXTRA_EOS}),
            validate=lambda ids, max_tokens=None: None,
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
        stream.num_prompt_tokens = len(prompt_ids)
        stream.arrival_time, stream.scheduled_time, stream.first_token_time = 0.0, None, None
        stream.itls = []
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


def run(outputs, n=1, **params):
    """(text, finish_reason, stop_reason, tokens counted) of every choice, the same collected
    and streamed; what the metrics hear (``on_finished``, ``on_tokens``) agrees with it."""

    def generation(finished, tokens):
        return Generation(
            FakeEngine(outputs),
            FakeTokenizer(),
            "r",
            [1],
            SamplingParams(**params),
            n=n,
            on_finished=lambda stats, itls: finished.append(stats),
            on_tokens=lambda prompt, generated: tokens.append(generated),
        )

    async def go():
        results = []
        finished, tokens = [], []
        choices = await generation(finished, tokens).collect()
        results.append(
            [(c.text, c.finish_reason, c.stop_reason, len(c.token_ids)) for c in choices]
        )
        finished2, tokens2 = [], []
        events = [ev async for ev in generation(finished2, tokens2).events()]
        streamed = []
        for i in range(n):
            mine = [ev for ev in events if ev.index == i]
            streamed.append(
                (
                    "".join(ev.text for ev in mine),
                    mine[-1].finish_reason,
                    mine[-1].stop_reason,
                    sum(len(ev.token_ids) for ev in mine),
                )
            )
        results.append(streamed)
        for got, stats, counted in ((results[0], finished, tokens), (streamed, finished2, tokens2)):
            assert sorted(s.finish_reason for s in stats) == sorted(c[1] for c in got)
            assert sum(s.num_generation_tokens for s in stats) == sum(counted)
            assert sum(counted) == sum(c[3] for c in got)
        return results

    collected, streamed = asyncio.run(go())
    assert collected == streamed
    assert len(set(collected)) == 1  # every choice of the scripted engine alike
    return collected[0]


@pytest.mark.parametrize(
    "outputs,params,expected",
    [
        # several ids in one output, the last a stop token: its id
        ([out([1, 2, 7], STOP)], dict(stop_token_ids=[7]), ("xa", "stop", 7, 3)),
        # a stop string and a stop token in the same output: the string (it comes first), and
        # the tokens after it are not counted, merged or not
        ([out([2, 3, 4, 7], STOP)], dict(stop=["ab"], stop_token_ids=[7]), ("", "stop", "ab", 2)),
        (
            [out([1]), out([2]), out([3, 7], STOP)],
            dict(stop=["ab"], stop_token_ids=[7]),
            ("x", "stop", "ab", 3),
        ),
        # the tokenizer's own EOS: null, also when listed in stop_token_ids
        ([out([1, PRIMARY_EOS], STOP)], dict(), ("x", "stop", None, 2)),
        (
            [out([1, PRIMARY_EOS], STOP)],
            dict(stop_token_ids=[PRIMARY_EOS]),
            ("x", "stop", None, 2),
        ),
        # ... but with ignore_eos a listed EOS is a plain stop token: its id
        (
            [out([1]), out([PRIMARY_EOS], STOP)],
            dict(stop_token_ids=[PRIMARY_EOS], ignore_eos=True),
            ("x", "stop", PRIMARY_EOS, 2),
        ),
        # an EOS id generation_config adds: vLLM makes it a stop token id, reported
        ([out([1, EXTRA_EOS], STOP)], dict(), ("x", "stop", EXTRA_EOS, 2)),
        # the stop token's text kept: still its id
        (
            [out([1, 7], STOP)],
            dict(stop_token_ids=[7], include_stop_str_in_output=True),
            ("xq", "stop", 7, 2),
        ),
        # a length finish: null, even when the last id is a stop token (the engine said length)
        ([out([1, 7], LENGTH)], dict(stop_token_ids=[7]), ("xq", "length", None, 2)),
        # "ab" completes only when the held-back bytes are flushed at the end (id 5 ends inside
        # a UTF-8 character): cut there, reported as a stop at "ab", whatever ended the output
        ([out([1]), out([2]), out([5], LENGTH)], dict(stop=["ab"]), ("x", "stop", "ab", 3)),
        (
            [out([1]), out([2]), out([5, PRIMARY_EOS], STOP)],
            dict(stop=["ab"]),
            ("x", "stop", "ab", 4),
        ),
        (
            [out([1]), out([2]), out([5, 7], STOP)],
            dict(stop=["ab"], stop_token_ids=[7]),
            ("x", "stop", "ab", 4),
        ),
        # ... and a character completed within the output: no half-decoded text ever matches
        (
            [out([1]), out([5]), out([6], LENGTH)],
            dict(stop=["b\ufffd"]),
            ("xb\u00e9", "length", None, 3),
        ),
    ],
)
@pytest.mark.parametrize("n", [1, 2])
def test_stop_reason(outputs, params, expected, n):
    assert run(outputs, n=n, **params) == expected
