"""Structured outputs inside the engine (no HTTP): grammars compiled by llguidance in the engine
core, bitmasks applied in the sampler, matchers advanced with every token.

The embedded model has random weights, so its free output is gibberish: every valid output
below is the grammar's doing. Outputs are checked with the ``jsonschema`` validator (formats
included) and Python's ``re``; nothing here compares the engine with itself.
"""

from __future__ import annotations

import ctypes
import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from llguidance import LLMatcher

from engine.core.config import EngineConfig
from engine.core.request import FinishReason, SamplingParams
from engine.core.structured_output import StructuredOutputSpec, bitmask_words
from engine.frontend.tokenizer import Tokenizer
from engine.loader.embedded import ensure_embedded_checkpoint
from engine.worker.build import build_engine
from kernels.reference import apply_token_bitmask_ref
from server.structured_outputs import JSON_OPTIONS
from tests.integration.schemas import SCHEMAS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

OPTIONS = JSON_OPTIONS  # the server's (its layout, and oneOf enforced as anyOf)


@pytest.fixture(scope="module")
def embedded():
    path = str(ensure_embedded_checkpoint())
    return path, Tokenizer(path)


def _engine(path, tok, **kw):
    cfg = dict(model=path, num_kv_blocks=2048, max_num_seqs=64, max_model_len=1024)
    cfg.update(kw)
    return build_engine(EngineConfig(**cfg), eos_token_ids=tok.eos_token_ids)


def _json(schema) -> StructuredOutputSpec:
    return StructuredOutputSpec(LLMatcher.grammar_from_json_schema(schema, defaults=OPTIONS))


def _run(eng):
    outs = {}
    steps = 0
    while eng.has_unfinished():
        for o in eng.step()[0]:
            outs.setdefault(o.request_id, []).append(o)
        steps += 1
        assert steps < 5000
    return outs


def _validate(schema, text):
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


def test_every_schema_output_validates_at_temperature_1(embedded):
    path, tok = embedded
    eng = _engine(path, tok)
    prompt = tok.encode("Write JSON:")
    reqs = [
        eng.add_request(
            f"s{i}",
            prompt,
            SamplingParams(temperature=1.0, max_tokens=400, seed=i, structured_output=_json(s)),
        )
        for i, s in enumerate(SCHEMAS)
    ]
    _run(eng)
    assert len(SCHEMAS) >= 50
    for schema, req in zip(SCHEMAS, reqs):
        assert req.finish_reason == FinishReason.STOP, (schema, tok.decode(req.output_token_ids))
        _validate(schema, tok.decode(req.output_token_ids))
    assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache_manager.num_blocks


def test_grammar_survives_preemption_and_async_scheduling(embedded):
    """A cache too small for the batch forces preemption (recompute keeps the matcher, whose
    tokens stay accepted); async scheduling is on (grammar requests defer their sampling until
    the previous step's tokens have advanced the matchers)."""
    path, tok = embedded
    eng = _engine(
        path,
        tok,
        num_kv_blocks=24,
        block_size=16,
        max_num_seqs=8,
        async_scheduling=True,
        max_num_batched_tokens=64,
    )
    schema = {
        "type": "array",
        "items": {"enum": ["alpha", "beta", "gamma"]},
        "minItems": 30,
        "maxItems": 30,
    }
    reqs = [
        eng.add_request(
            f"p{i}",
            tok.encode("x" * (5 + i)),
            SamplingParams(
                temperature=1.0, seed=i, max_tokens=200, structured_output=_json(schema)
            ),
        )
        for i in range(6)
    ]
    _run(eng)
    assert eng.scheduler.num_preemptions > 0, "the cache is meant to force preemptions"
    for r in reqs:
        assert r.finish_reason == FinishReason.STOP
        _validate(schema, tok.decode(r.output_token_ids))
    assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache_manager.num_blocks


def test_deferred_sampling_equals_synchronous_steps_and_keeps_a_step_in_flight(embedded):
    """Async scheduling with grammar, penalty and plain requests in one batch: each step's
    forward is queued before the previous step's tokens are applied, the sampling after (with
    the bitmask of the advanced matchers). The tokens equal those of the synchronous engine
    (same seeds), every grammar output validates, and a step stays in flight between calls
    while the grammar requests run (the steps are not drained to synchronous ones)."""
    path, tok = embedded
    schema = {
        "type": "array",
        "items": {"enum": ["alpha", "beta", "gamma"]},
        "minItems": 12,
        "maxItems": 12,
    }

    def add_all(eng):
        reqs = []
        for i in range(4):
            params = SamplingParams(
                temperature=1.0, seed=i, max_tokens=120, structured_output=_json(schema)
            )
            reqs.append(eng.add_request(f"g{i}", tok.encode("list " * (i + 1)), params))
        for i in range(2):
            params = SamplingParams(temperature=1.0, seed=10 + i, max_tokens=30, ignore_eos=True)
            reqs.append(eng.add_request(f"f{i}", tok.encode("free " * (i + 2)), params))
        params = SamplingParams(
            temperature=1.0, seed=20, max_tokens=30, frequency_penalty=1.0, min_tokens=5
        )
        reqs.append(eng.add_request("p", tok.encode("penalised"), params))
        return reqs

    sync_eng = _engine(path, tok, async_scheduling=False)
    ref = add_all(sync_eng)
    _run(sync_eng)
    eng = _engine(path, tok, async_scheduling=True)
    got = add_all(eng)
    in_flight_with_grammar = 0
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        assert steps < 2000
        grammar_running = any(r.request_id.startswith("g") for r in eng.scheduler.running)
        in_flight_with_grammar += grammar_running and eng._in_flight is not None
    for a, b in zip(ref, got):
        assert a.output_token_ids == b.output_token_ids, a.request_id
        assert a.finish_reason == b.finish_reason
    for r in got[:4]:
        assert r.finish_reason == FinishReason.STOP
        _validate(schema, tok.decode(r.output_token_ids))
    assert in_flight_with_grammar > 10
    assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache_manager.num_blocks


def test_completed_grammar_ends_the_request_whatever_ignore_eos_and_min_tokens(embedded):
    path, tok = embedded
    eng = _engine(path, tok)
    spec = StructuredOutputSpec(LLMatcher.grammar_from_regex("ab(c|d)"))
    r = eng.add_request(
        "r",
        tok.encode("hi"),
        SamplingParams(
            temperature=1.0, max_tokens=50, ignore_eos=True, min_tokens=40, structured_output=spec
        ),
    )
    _run(eng)
    text = tok.decode(r.output_token_ids)
    assert r.finish_reason == FinishReason.STOP and re.fullmatch("ab(c|d)", text), text


def test_grammar_starts_after_the_start_token(embedded):
    """``start_after_token``: the tokens up to it are free (here a logit bias forces that token
    first), the rest must match; the bias cannot override the mask afterwards."""
    path, tok = embedded
    think_end = tok.token_to_id("</think>")
    eng = _engine(path, tok)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    spec = StructuredOutputSpec(_json(schema).grammar, start_after_token=think_end)
    r = eng.add_request(
        "r",
        tok.encode("hi"),
        SamplingParams(
            temperature=1.0, max_tokens=50, logit_bias={think_end: 100.0}, structured_output=spec
        ),
    )
    _run(eng)
    assert r.output_token_ids[0] == think_end
    assert think_end not in r.output_token_ids[1:]
    _validate(schema, tok.decode(r.output_token_ids[1:]))
    assert r.finish_reason == FinishReason.STOP


def test_logprobs_report_the_constrained_distribution(embedded):
    path, tok = embedded
    eng = _engine(path, tok)
    spec = StructuredOutputSpec(LLMatcher.grammar_from_regex("(yes|no)"))
    eng.add_request(
        "r",
        tok.encode("hi"),
        SamplingParams(temperature=1.0, max_tokens=5, logprobs=20, structured_output=spec),
    )
    outs = _run(eng)["r"]
    first = outs[0].logprobs[0]
    allowed = {alt for alt, lp in first[1] if lp > float("-inf")}
    texts = {tok.decode([a]) for a in allowed}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    total = sum(torch.tensor([lp for _, lp in first[1]]).exp().tolist())
    assert total == pytest.approx(1.0, abs=1e-3)  # the mass lies on the few allowed tokens


def test_a_grammar_that_does_not_compile_fails_only_its_request(embedded):
    """The front end validates grammars first; if one still fails in the engine, that request
    ends with an error and the others run."""
    path, tok = embedded
    eng = _engine(path, tok)
    bad = StructuredOutputSpec(LLMatcher.grammar_from_regex("[a-z"))
    eng.add_request("bad", tok.encode("hi"), SamplingParams(max_tokens=5, structured_output=bad))
    ok = eng.add_request("ok", tok.encode("hi"), SamplingParams(max_tokens=3))
    outs = _run(eng)
    assert (
        outs["bad"][-1].finish_reason == FinishReason.ERROR
        and "structured output" in outs["bad"][-1].error
    )
    assert ok.finish_reason == FinishReason.LENGTH and len(ok.output_token_ids) == 3
    assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache_manager.num_blocks


def test_bitmask_reference_keeps_exactly_the_set_bits():
    g = torch.Generator().manual_seed(3)
    vocab = 100
    logits = torch.randn(3, vocab, generator=g)
    mask = torch.zeros(1, bitmask_words(vocab), dtype=torch.int32)
    allowed = [0, 5, 31, 32, 63, 99]
    for t in allowed:
        mask[0, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    out = apply_token_bitmask_ref(logits.clone(), torch.tensor([1]), mask)
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == allowed
    assert torch.equal(out[[0, 2]], logits[[0, 2]])


def test_grammar_failures_are_the_requests_or_the_engines(embedded):
    """Who a grammar failure is blamed on: a token the step's mask allowed that the grammar
    then rejects is the request's grammar's error (``GRAMMAR_ERROR_PREFIX``: HTTP 400); a token
    the mask forbade (a sampler fault) or a compile failing in the engine is the engine's."""
    from concurrent.futures import Future

    from engine.core.structured_output import (
        GRAMMAR_ERROR_PREFIX,
        GrammarState,
        StructuredOutputManager,
        _mask_allows,
    )

    path, tok = embedded
    manager = StructuredOutputManager(f"{path}/tokenizer.json", 151936, tok.eos_token_ids)
    spec = StructuredOutputSpec(LLMatcher.grammar_from_regex("ab"))

    def state():
        st = GrammarState(spec, manager.template(spec))
        st.compiled.result(timeout=120)
        assert st.ready()
        return st

    a, b = tok.encode("a")[0], tok.encode("b")[0]
    # the bit layout against llguidance's unpacked mask (compute_logit_bias: one byte per
    # token, 200 where allowed), every id, on a grammar allowing many tokens (lowercase words)
    words = StructuredOutputSpec(LLMatcher.grammar_from_regex("[a-z]+"))
    probe = GrammarState(words, manager.template(words))
    probe.compiled.result(timeout=120)
    assert probe.ready()
    manager.fill_bitmasks([state(), probe])  # the probe's row is the second
    bias = probe._matcher.compute_logit_bias()
    allowed = [t for t in range(151936) if _mask_allows(probe._mask, t)]
    assert allowed == [t for t, v in enumerate(bias) if v] and len(allowed) > 100
    forbidden = state()
    manager.fill_bitmasks([forbidden])
    forbidden.accept(b)  # "b" first: outside the mask
    assert forbidden.error and forbidden.engine_fault
    assert not forbidden.failure_message.startswith(GRAMMAR_ERROR_PREFIX)
    unmasked = state()
    unmasked.accept(b)  # sampled without a mask
    assert unmasked.engine_fault
    fine = state()
    manager.fill_bitmasks([fine])
    fine.accept(a)
    assert fine.error is None
    manager.fill_bitmasks([fine])
    fine.accept(b)
    assert fine.error is None and fine.completed
    # allowed by the mask, rejected by the matcher (as when llguidance hits a limit on an
    # allowed token): the request's grammar's failure
    own = state()
    own._mask = (bytearray(b"\xff" * manager.mask_bytes), 0, manager.mask_bytes)
    own.accept(b)
    assert own.error and not own.engine_fault
    assert own.failure_message.startswith(GRAMMAR_ERROR_PREFIX + "token ")
    failed = GrammarState(spec, Future())
    failed.compiled.set_exception(MemoryError("out of memory"))
    assert failed.ready() and failed.engine_fault
    assert "grammar compilation failed: MemoryError" in failed.failure_message
    manager.shutdown()


@pytest.mark.parametrize(
    "regex,reason",
    [("(", "unclosed group"), ("[z-a]", "invalid character class range")],
)
def test_matcher_errors_keep_the_reason_and_drop_the_dump(embedded, regex, reason):
    """llguidance's message for a bad regex names its reason on a later line (below the pattern
    and a caret): the client's one-line message keeps it, and nothing of the rest."""
    from pathlib import Path

    from llguidance import LLTokenizer

    from engine.core.structured_output import matcher_error

    path, tok = embedded
    llg = LLTokenizer((Path(path) / "tokenizer.json").read_text(), n_vocab=tok.vocab_size)
    matcher = LLMatcher(llg, LLMatcher.grammar_from_regex(regex), log_level=0)
    assert matcher.is_error()
    msg = matcher_error(matcher)
    assert "\n" not in msg and "^" not in msg, msg
    assert "regex parse error: " + reason in msg, msg


def test_special_token_corrections_keep_what_the_grammar_asks_for(embedded):
    # A grammar that asks for the special token itself (llguidance's token syntax, as the
    # tool-call grammar does) keeps it allowed; one whose forced text merely equals its text
    # gets the token's ordinary spelling instead (llguidance's mask offered the special token,
    # which its parser then refused).
    from llguidance import LLTokenizer

    from engine.core.structured_output import (
        _mask_allows,
        consume_forced,
        correct_special_tokens,
        special_spellings,
    )

    path, tok = embedded
    llg = LLTokenizer((Path(path) / "tokenizer.json").read_text())
    spellings = special_spellings(llg)
    call = tok.encode("<tool_call>")
    assert len(call) == 1 and call[0] in spellings
    call = call[0]
    assert "".join(tok.decode([t]) for t in spellings[call]) == "<tool_call>"

    def mask_of(matcher):
        buf = bytearray(4 * bitmask_words(llg.vocab_size))
        view = (ctypes.c_char * len(buf)).from_buffer(buf)
        matcher.unsafe_compute_mask_ptr(ctypes.addressof(view), len(buf))
        del view
        return (buf, 0, len(buf))

    asks = LLMatcher(llg, LLMatcher.grammar_from_lark('start: <tool_call> "x"'), log_level=0)
    mask = mask_of(asks)
    assert _mask_allows(mask, call)
    correct_special_tokens(asks, mask, spellings)
    assert _mask_allows(mask, call) and asks.consume_token(call)

    text = LLMatcher(llg, LLMatcher.grammar_from_regex("<tool_call>x"), log_level=0)
    mask = mask_of(text)
    assert _mask_allows(mask, call) and text.validate_tokens([call]) == 0
    correct_special_tokens(text, mask, spellings)
    first = spellings[call][0]
    assert not _mask_allows(mask, call) and _mask_allows(mask, first)
    assert consume_forced(text, text.compute_ff_tokens(), spellings) and text.is_accepting()


def test_engine_masks_spell_special_token_text_and_keep_eos(embedded):
    # The engine's own masks (the model's 151,936-wide vocabulary, padding ids included), a
    # greedy walk over what each mask allows: a forced special token's text comes out spelled
    # with ordinary tokens, every allowed token is one the matcher takes, and at an accepting
    # state the end-of-sequence ids stay allowed.
    from engine.core.structured_output import (
        GrammarState,
        StructuredOutputManager,
        _mask_allows,
    )

    path, tok = embedded
    manager = StructuredOutputManager(f"{path}/tokenizer.json", 151936, tok.eos_token_ids)
    try:
        spec = StructuredOutputSpec(LLMatcher.grammar_from_regex("[a-z]{2}<\\|im_start\\|>"))
        st = GrammarState(spec, manager.template(spec))
        manager.template(spec).result()
        assert st.ready() and not st.error
        # only the tokenizer's added tokens, not the ids that pad it to the model's width
        assert 20 <= len(manager._spellings) <= 40
        im_start = tok.encode("<|im_start|>")
        assert len(im_start) == 1
        out = []
        for _ in range(12):
            mask = (manager.fill_bitmasks([st]), 0, manager.mask_bytes)
            allowed = [t for t in range(151936) if _mask_allows(mask, t)]
            assert allowed and im_start[0] not in allowed
            for t in allowed[:50]:
                assert st._matcher.validate_tokens([t]) == 1, t
            st._mask = mask
            st.accept(allowed[0])
            assert st.error is None
            out.append(allowed[0])
            if st._matcher.is_accepting():
                break
        assert re.fullmatch("[a-z]{2}<\\|im_start\\|>", tok.decode(out)), tok.decode(out)

        loop = StructuredOutputSpec(LLMatcher.grammar_from_regex("(<think>)+"))
        st = GrammarState(loop, manager.template(loop))
        manager.template(loop).result()
        assert st.ready()
        think = manager._spellings[tok.encode("<think>")[0]]
        assert st._matcher.consume_tokens(think) and st._matcher.is_accepting()
        mask = (manager.fill_bitmasks([st]), 0, manager.mask_bytes)
        assert all(_mask_allows(mask, e) for e in tok.eos_token_ids)
    finally:
        manager.shutdown()
