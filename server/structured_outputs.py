"""Request fields -> the grammar a completion must match, validated before anything is generated.

Sources (at most one per request): OpenAI's ``response_format`` (``json_schema``,
``json_object``; ``text`` means none), vLLM's ``structured_outputs`` (``json``, ``regex``,
``choice``, ``grammar``, ``json_object``) and its older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` fields, and enforced tool calls (``tool_choice``
"required" or a named function). The grammar engine is llguidance (see
``engine/core/structured_output.py`` and docs/api.md for why): this module turns each source
into an llguidance grammar, then validates it against the checkpoint's tokenizer in a worker
thread under a time bound, so a bad or pathological grammar is a 400 naming the parameter and
never a stalled event loop or a request accepted and ignored.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from engine.core.structured_output import consume_forced, llg_tokenizer, matcher_error
from server.errors import APIError
from server.protocol import SamplingFields

#: llguidance's JSON options: the layout the grammar allows -- the separators of ``json.dumps``
#: (and of the chat templates' ``tojson``, so tool calls look as the model was taught), no other
#: whitespace (near-flat logits would otherwise wander through it) -- and ``oneOf`` enforced as
#: ``anyOf`` where llguidance cannot show its alternatives disjoint (a discriminated union over
#: ``$ref``s, e.g.; it refuses such a schema otherwise), as xgrammar does and as the openai
#: client's ``parse()`` rewrites it; a schema's own ``x-guidance`` key overrides these
JSON_OPTIONS = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "coerce_one_of": True,
}

#: the parameters of a function defined without ``parameters`` (OpenAI: "an empty parameter list")
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}

#: Qwen's tool-call block (Qwen3 and Qwen2.5 chat templates), as the model is taught to write it
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


def _regex_literal(text: str) -> str:
    """``text`` as a regex matching exactly it (Rust regex syntax: escape metacharacters only)."""
    return "".join("\\" + c if c in r"\.+*?()|[]{}^$#&-~" else c for c in text)


def _lark_literal(text: str) -> str:
    """``text`` as a Lark string literal (JSON escapes are valid Lark escapes)."""
    return json.dumps(text, ensure_ascii=False)


def _json_grammar(schema: Any, param: str) -> str:
    from llguidance import LLMatcher

    if not isinstance(schema, (dict, bool)):
        raise APIError(400, "the JSON schema must be an object", param)
    try:
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise APIError(400, f"invalid JSON schema: {exc}", param) from None


def tool_parameters_grammars(tools: list, name: str | None) -> list[tuple[str, str]]:
    """(grammar, parameter name) of each enforced tool's ``parameters`` schema, so that a schema
    the engine cannot enforce is reported against ``tools.<i>.function.parameters`` rather than
    the combined tool-call grammar (``tools``: the request's ``ToolDef`` objects; ``name``: the
    named function, or None for all).

    Raises:
        APIError: 400 for a schema that is not an object or does not convert."""
    out = []
    for i, tool in enumerate(tools):
        fn = tool.function
        if fn.parameters is None or (name is not None and fn.name != name):
            continue
        param = f"tools.{i}.function.parameters"
        out.append((_json_grammar(fn.parameters, param), param))
    return out


def _choice_grammar(choices: Any, param: str) -> str:
    from llguidance import LLMatcher

    if (
        not isinstance(choices, list)
        or not choices
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise APIError(400, "choice must be a non-empty list of non-empty strings", param)
    return LLMatcher.grammar_from_regex("(" + "|".join(_regex_literal(c) for c in choices) + ")")


def _regex_grammar(regex: Any, param: str) -> str:
    from llguidance import LLMatcher

    if not isinstance(regex, str) or not regex:
        raise APIError(400, "regex must be a non-empty string", param)
    return LLMatcher.grammar_from_regex(regex)


def _lark_grammar(grammar: Any, param: str) -> str:
    """A grammar in llguidance's Lark dialect, or in GBNF (llama.cpp's; converted with
    llguidance's ``any_to_lark``, which tells the two apart)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if not isinstance(grammar, str) or not grammar.strip():
        raise APIError(400, "grammar must be a non-empty string", param)
    try:
        grammar = any_to_lark(grammar)
    except Exception as exc:  # noqa: BLE001 - any conversion failure is the request's fault
        raise APIError(400, f"invalid grammar: {exc}", param) from None
    return LLMatcher.grammar_from_lark(grammar)


def tool_call_grammar(
    tools: list[dict], name: str | None, parallel: bool, special: dict[str, bool]
) -> str:
    """The grammar of the checkpoint's own tool-call format: one or more (``parallel``) blocks
    ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` separated by newlines,
    ``arguments`` valid against the chosen function's ``parameters`` schema.

    Args:
        tools: the request's tools (``{"type": "function", "function": {...}}`` dicts).
        name: the only function allowed (``tool_choice`` named), or None for any of them.
        parallel: allow several calls (``parallel_tool_calls``).
        special: tag -> whether the tokenizer holds it as one added token (then the grammar
            asks for that token, as the model writes it; else for its text).
    """
    from llguidance import LLMatcher

    options = []
    for tool in tools:
        fn = tool["function"]
        if name is not None and fn["name"] != name:
            continue
        options.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": fn["name"]},
                    "arguments": fn.get("parameters") or NO_PARAMETERS,
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    body = {"anyOf": options} if len(options) > 1 else options[0]
    body["x-guidance"] = JSON_OPTIONS
    start = TOOL_CALL_START if special.get(TOOL_CALL_START) else _lark_literal(TOOL_CALL_START)
    end = TOOL_CALL_END if special.get(TOOL_CALL_END) else _lark_literal(TOOL_CALL_END)
    rules = [f'call: {start} "\\n" args "\\n" {end}', "args: %json " + json.dumps(body)]
    rules.insert(0, 'start: call ("\\n" call)*' if parallel else "start: call")
    return LLMatcher.grammar_from_lark("\n".join(rules) + "\n")


def grammar_from_request(req: SamplingFields) -> tuple[str | None, str]:
    """(llguidance grammar or None, the parameter it came from) of a request's structured-output
    fields: ``response_format``, ``structured_outputs``, ``guided_json``, ``guided_regex``,
    ``guided_choice``, ``guided_grammar``.

    Raises:
        APIError: 400 for two sources at once or a malformed value.
    """
    found = []
    rf = req.response_format
    if rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise APIError(
                400, "response_format.json_schema.schema is required", "response_format.json_schema"
            )
        param = "response_format.json_schema.schema"
        found.append((param, _json_grammar(rf.json_schema.schema_, param)))
    elif rf is not None and rf.type == "json_object":
        found.append(("response_format", _json_grammar({"type": "object"}, "response_format")))
    so = req.structured_outputs
    if so is not None:
        given = {
            "json": so.json_,
            "regex": so.regex,
            "choice": so.choice,
            "grammar": so.grammar,
            "json_object": so.json_object or None,
        }
        kinds = [k for k, v in given.items() if v is not None]
        if len(kinds) != 1:
            raise APIError(
                400,
                "structured_outputs must set exactly one of json, regex, choice, "
                "grammar, json_object",
                "structured_outputs",
            )
        kind = kinds[0]
        param = f"structured_outputs.{kind}"
        found.append((param, _build(kind, given[kind], param)))
    for kind, value in (
        ("json", req.guided_json),
        ("regex", req.guided_regex),
        ("choice", req.guided_choice),
        ("grammar", req.guided_grammar),
    ):
        if value is not None:
            found.append((f"guided_{kind}", _build(kind, value, f"guided_{kind}")))
    if len(found) > 1:
        raise APIError(
            400,
            "give one structured-output constraint, got " + ", ".join(p for p, _ in found),
            found[1][0],
        )
    return (found[0][1], found[0][0]) if found else (None, "")


def _build(kind: str, value: Any, param: str) -> str:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise APIError(400, "the JSON schema is not valid JSON", param) from None
        return _json_grammar(value, param)
    if kind == "json_object":
        return _json_grammar({"type": "object"}, param)
    if kind == "regex":
        return _regex_grammar(value, param)
    if kind == "choice":
        return _choice_grammar(value, param)
    return _lark_grammar(value, param)


class GrammarValidator:
    """Checks grammars against the checkpoint's tokenizer off the event loop, with a time bound.

    The llguidance tokenizer is built on first use (~2 s for a 150k vocabulary) in a worker
    thread; results (valid, or the error) are cached by grammar hash.

    Args:
        tokenizer_json: the checkpoint's tokenizer.json; vocab_size: the model's logits width;
        eos_token_ids: ids that end generation.
        timeout_s: the longest a compilation may take before the request gets a 400.

    The checks run on the validator's own worker threads (:data:`CHECK_THREADS`), not the event
    loop's default pool: there, prompts being encoded and long chat templates being rendered
    could hold every thread, and the wait for one would count against ``timeout_s`` (a trivial
    schema got "took over 3 s to compile" behind six 60,000-message renders).
    """

    #: grammars checked at once (a compile beyond them waits for one to finish)
    CHECK_THREADS = 2

    def __init__(
        self,
        tokenizer_json: str | Path,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        timeout_s: float = 10.0,
        capacity: int = 1024,
    ):
        self.tokenizer_json = Path(tokenizer_json)
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.timeout_s = timeout_s
        self.capacity = capacity
        self._lock = threading.Lock()
        self._tokenizer = None
        self._spellings: dict[int, list[int]] = {}
        self._results: OrderedDict[str, str] = OrderedDict()  # grammar hash -> "" or error
        self._pool = ThreadPoolExecutor(self.CHECK_THREADS, thread_name_prefix="grammar-check")

    def _llg_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                tokenizer, self._spellings = llg_tokenizer(
                    self.tokenizer_json, self.vocab_size, self.eos_token_ids
                )
                self._tokenizer = tokenizer
            return self._tokenizer

    def _check(self, grammar: str) -> str:
        """ "" for a grammar that compiles and can start an output, else why not.

        Beyond compiling, the grammar's first step is computed as the engine will compute it:
        the first token mask (a grammar no text matches, e.g. ``root ::= root``, allows no
        token: the engine would end the request with an empty, non-matching output) and the
        tokens it forces from the start, consumed (a grammar whose every derivation is endless,
        e.g. ``root ::= "(" root ")"`` or a JSON schema whose required properties recurse
        forever, forces tokens until llguidance gives up mid-request).
        """
        from llguidance import LLMatcher

        matcher = LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            return matcher_error(matcher)
        matcher.compute_bitmask()
        if matcher.is_error() or (matcher.is_stopped() and not matcher.is_accepting()):
            return "no text matches it"
        forced = matcher.compute_ff_tokens()
        # (forced text that equals a special token's is spelled with ordinary tokens, as the
        # engine's masks spell it: engine.core.structured_output.special_spellings)
        if forced and not consume_forced(matcher, forced, self._spellings) or matcher.is_error():
            # llguidance stops on its item limits here: the forced start of a grammar whose every
            # derivation is endless never ends ("Too many items ... ff_tokens"), and a rule of
            # more alternatives than one parser row holds ("Current row has 2500 items; max is
            # 2000", e.g. the tools of an enforced call) stops at its first token
            reason = matcher_error(matcher).split("; consider making your grammar")[0]
            return (
                f"it stops on its forced start ({reason}): either no finite text matches it "
                "(every derivation is endless), or a rule the output starts with has more "
                "alternatives than llguidance takes (2,000, e.g. the tools of an enforced tool "
                "call)"
            )
        return ""

    async def validate(self, grammar: str, param: str) -> None:
        """Compile ``grammar`` once (cached) within ``timeout_s``.

        Raises:
            APIError: 400 naming ``param`` when it does not compile, or takes too long.
        """
        key = hashlib.sha256(grammar.encode()).hexdigest()
        error = self._results.get(key)
        if error is None:
            try:
                check = asyncio.get_running_loop().run_in_executor(self._pool, self._check, grammar)
                error = await asyncio.wait_for(check, self.timeout_s)
            except asyncio.TimeoutError:
                raise APIError(
                    400,
                    f"the grammar took over {self.timeout_s:g} s to compile; simplify it",
                    param,
                ) from None
            self._results[key] = error
            while len(self._results) > self.capacity:
                self._results.popitem(last=False)
        if error:
            raise APIError(
                400,
                f"{param} is invalid or asks for what the grammar engine cannot enforce: {error}",
                param,
            )
