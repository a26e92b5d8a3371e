"""Tokenizer of a Hugging Face-format checkpoint directory: encode, decode, chat template.

Wraps `tokenizers.Tokenizer` (``tokenizer.json``) and renders the checkpoint's Jinja chat
template the way transformers' ``apply_chat_template`` does (same sandboxed environment,
helpers and message normalisation), so prompts match what transformers would build.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

__all__ = ["ChatTemplateError", "Tokenizer"]

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


class ChatTemplateError(ValueError):
    """The chat template is missing, does not compile, or failed while rendering.

    The original Jinja error (e.g. `jinja2.exceptions.SecurityError` when a template reaches
    for Python internals, `TemplateError` from ``raise_exception``) is the ``__cause__``.
    """


class Tokenizer:
    """Tokenizer and chat template of a checkpoint directory.

    Reads ``tokenizer.json`` (required), ``tokenizer_config.json``, ``chat_template.jinja``
    and ``generation_config.json`` (all optional).

    Attributes:
        path: the checkpoint directory.
        chat_template: the template used by `apply_chat_template` when no tools are given
            (``None`` if the checkpoint has none).
        eos_token: the tokenizer_config's eos token text, or ``None``.
        bos_token, pad_token: likewise.
        eos_token_ids: ids that end generation: the eos_token's id plus generation_config's
            ``eos_token_id`` (int or list).
        eos_token_id: the eos_token's own id (the tokenizer's primary EOS), or ``None``.
        pad_token_id, bos_token_id: ids of those tokens, or ``None``.
        special_token_ids: ids of added tokens flagged special (skipped by
            ``decode(skip_special_tokens=True)``).
        added_tokens: text -> id of every added token (``<|im_end|>``, ``<tool_call>``, ...).
        model_max_length: tokenizer_config's ``model_max_length`` or ``None``.

    Raises (constructor):
        FileNotFoundError: no ``tokenizer.json`` in the directory.
        ValueError: a config file is not valid JSON.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        tokenizer_file = self.path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {self.path}")
        self._tok = _HFTokenizer.from_file(str(tokenizer_file))
        config = _read_json(self.path / "tokenizer_config.json")
        generation = _read_json(self.path / "generation_config.json")

        self._templates = _load_templates(self.path, config)
        self.chat_template: str | None = self._templates.get("default")
        self._compiled: dict[str, jinja2.Template] = {}

        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.pad_token = _token_text(config.get("pad_token"))
        self.unk_token = _token_text(config.get("unk_token"))
        self.bos_token_id = self._id_or_none(self.bos_token)
        self.pad_token_id = self._id_or_none(self.pad_token)
        self.eos_token_id = self._id_or_none(self.eos_token)
        eos_ids = set()
        if self.eos_token_id is not None:
            eos_ids.add(self.eos_token_id)
        gen_eos = generation.get("eos_token_id")
        if isinstance(gen_eos, int):
            eos_ids.add(gen_eos)
        elif isinstance(gen_eos, list):
            eos_ids.update(int(i) for i in gen_eos)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        added = self._tok.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, tok in added.items() if tok.special
        )
        self.added_tokens: dict[str, int] = {tok.content: i for i, tok in added.items()}
        self.model_max_length: int | None = config.get("model_max_length")

    # ------------------------------------------------------------------ tokens

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included (151669 for Qwen3).

        The model's embedding may be larger (151936 for Qwen3); decode skips ids past this.
        """
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`.

        Added tokens written in the text (e.g. ``<|im_start|>``) map to their ids.
        `add_special_tokens` applies the tokenizer's post-processor (for Qwen it adds nothing).
        Runs through ``encode_batch``, which releases the GIL while it works (``encode`` holds
        it), so the server can encode long prompts in a worker thread without stalling its
        event loop; the ids are the same.
        """
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; invalid UTF-8 byte sequences become U+FFFD; unknown ids are skipped.

        With `skip_special_tokens`, tokens flagged special (``<|im_end|>``...) are dropped;
        non-special added tokens such as ``<think>`` or ``<tool_call>`` are kept.
        """
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(
        self, prefill_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> Callable[[int], str | None] | None:
        """An incremental decoder: feed one generated id per call, get its new text or ``None``.

        `tokenizers.decoders.DecodeStream` (the prefix/read-offset method of TGI and vLLM's
        ``detokenize_incrementally``, in Rust: one call per token instead of two ``decode``
        calls). ``prefill_ids`` (e.g. the prompt's last few ids) are context only: their text
        is never returned. A call returns ``None`` while the ids since the last text end
        inside a UTF-8 character or add no text (skipped special tokens); it may raise
        ``Exception`` when a decode does not extend the previous one (the caller falls back
        to whole-window decoding).

        Returns ``None`` when the installed `tokenizers` has no ``DecodeStream`` taking
        prefill ids (before 0.22).
        """
        try:
            from tokenizers.decoders import DecodeStream

            stream = DecodeStream(list(prefill_ids), skip_special_tokens)
        except (ImportError, TypeError):
            return None
        tok = self._tok
        return lambda token_id: stream.step(tok, token_id)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        """Vocabulary strings (byte-level form, e.g. ``"Ġworld"``) of ids; ``None`` if unknown."""
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return [self._tok.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary string or added token, or ``None``."""
        return self._tok.token_to_id(token)

    def _id_or_none(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    # ------------------------------------------------------------------ chat

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation into a prompt string with the checkpoint's chat template.

        Mirrors transformers' ``apply_chat_template(tokenize=False)``: messages (dicts or
        pydantic models) are turned into plain dicts, keys whose value is ``None`` are dropped
        (OpenAI's ``content: null``), reasoning given as ``reasoning``/``thinking`` is also
        exposed as ``reasoning_content`` (and vice versa); the template sees ``messages``,
        ``tools``, ``documents`` (None), ``add_generation_prompt``, the special tokens
        (``bos_token``, ``eos_token``, ... when set) and `template_kwargs` (e.g.
        ``enable_thinking=False``). With tools, a template named ``tool_use`` is preferred if
        the checkpoint has named templates; otherwise ``default``.

        Raises:
            ChatTemplateError: no template, a template syntax error, ``raise_exception`` in the
                template, a sandbox violation (`jinja2.exceptions.SecurityError`), a value
                nested deeper than Python's recursion limit allows, or any other rendering
                failure; the original error is chained as ``__cause__``.
        """
        reserved = _RESERVED_VARIABLES.intersection(template_kwargs)
        if reserved:
            raise ChatTemplateError(f"template_kwargs cannot set {sorted(reserved)}")
        name = "tool_use" if tools is not None and "tool_use" in self._templates else "default"
        template = self._compiled_template(name)
        variables = self._special_tokens_map()
        try:  # (a JSON value nested some hundreds deep: a tool schema, call arguments)
            variables.update(_plain(template_kwargs))
            variables.update(
                messages=_alias_reasoning([_drop_none(_plain(m)) for m in messages]),
                tools=_plain(list(tools)) if tools is not None else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
            )
        except RecursionError as e:
            raise ChatTemplateError("a value is nested too deeply to render") from e
        try:
            return template.render(**variables)
        except SecurityError as e:
            raise ChatTemplateError(f"chat template violated the sandbox: {e}") from e
        except TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from e
        except Exception as e:  # a template bug such as calling a missing method
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e

    def _special_tokens_map(self) -> dict[str, Any]:
        """Template variables for the special tokens that are set, as transformers passes them."""
        tokens = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": self.unk_token,
            "pad_token": self.pad_token,
        }
        return {k: v for k, v in tokens.items() if v is not None}

    def _compiled_template(self, name: str) -> jinja2.Template:
        if name not in self._compiled:
            source = self._templates.get(name)
            if source is None:
                raise ChatTemplateError(f"checkpoint {self.path} has no chat template")
            try:
                self._compiled[name] = _jinja_env().from_string(source)
            except TemplateError as e:
                raise ChatTemplateError(f"chat template does not compile: {e}") from e
        return self._compiled[name]


# ---------------------------------------------------------------------- helpers


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special-token entry of tokenizer_config: a string or a serialized AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _load_templates(path: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Named chat templates: ``chat_template.jinja`` (preferred, as in transformers) or the
    tokenizer_config's ``chat_template`` (a string, or a list of ``{"name", "template"}``)."""
    templates: dict[str, str] = {}
    raw = config.get("chat_template")
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):
        for entry in raw:
            if isinstance(entry, Mapping) and "name" in entry and "template" in entry:
                templates[str(entry["name"])] = str(entry["template"])
    elif isinstance(raw, Mapping):
        templates.update({str(k): str(v) for k, v in raw.items()})
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    return templates


def _plain(value: Any) -> Any:
    """Rebuild `value` from plain JSON-like types (pydantic models via ``model_dump``)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _drop_none(message: Any) -> Any:
    if not isinstance(message, dict):
        raise ChatTemplateError(f"chat messages must be dicts, got {type(message).__name__}")
    return {k: v for k, v in message.items() if v is not None}


def _alias_reasoning(messages: Iterable[dict]) -> list[dict]:
    """Expose a message's reasoning under both ``reasoning_content`` and ``thinking``."""
    out = []
    for message in messages:
        reasoning = next(
            (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators=None,
    sort_keys: bool = False,
) -> str:
    """``tojson`` filter as in transformers: plain json.dumps, no HTML escaping, non-ASCII kept."""
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str):
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict`` global for templates without exposing the type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace`` that refuses underscore-prefixed attributes (as transformers does)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(
                f"templates cannot set underscore attributes on a namespace: {name!r}"
            )


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag): renders
    its body unchanged."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


_ENV: ImmutableSandboxedEnvironment | None = None


def _jinja_env() -> ImmutableSandboxedEnvironment:
    """The shared sandboxed environment, configured like transformers' chat template env."""
    global _ENV
    if _ENV is None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.globals["dict"] = _TemplateDict()
        env.globals["namespace"] = _TemplateNamespace
        _ENV = env
    return _ENV
