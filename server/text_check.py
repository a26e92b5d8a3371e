"""Reject request text that cannot be encoded: lone UTF-16 surrogates.

JSON allows ``"\\ud800"`` (an escape of half a surrogate pair: what a JavaScript client sends
when it cuts an emoji in half), and ``json.loads`` turns it into a Python ``str`` holding the
surrogate, which no UTF-8 encoder accepts: the tokenizer raised, the chat template's output
could not be tokenized, an error message quoting the value could not be written -- each a 500.
:func:`check_request_text` walks every string of a parsed request (model names, messages and
their parts, tool definitions and call arguments, template variables, stop strings, dict keys
included) before anything uses them, and names the first one that is not valid Unicode.
"""

from __future__ import annotations

from pydantic import BaseModel

from server.errors import APIError


def _bad(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def find_unencodable(value, path: str = "") -> str | None:
    """The dotted path (``messages.0.content``, the form validation errors use) of the first
    string in ``value`` (a pydantic model, list, dict or scalar) that is not encodable as UTF-8;
    None when every string is. A bad dict key is reported at the dict's path. Of a model, the
    fields set (``model_fields_set``: given by the client, or assigned since) are walked."""
    if isinstance(value, str):
        return path if _bad(value) else None
    if isinstance(value, BaseModel):
        given = value.model_fields_set  # the others hold this server's own defaults
        for name in type(value).model_fields:
            if name not in given:
                continue
            found = find_unencodable(getattr(value, name), f"{path}.{name}" if path else name)
            if found is not None:
                return found
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and _bad(key):
                return path
            found = find_unencodable(item, f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
        return None
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = find_unencodable(item, f"{path}.{i}" if path else str(i))
            if found is not None:
                return found
    return None


def check_request_text(request: BaseModel) -> None:
    """Raises APIError 400 naming the first string field of ``request`` that holds a lone
    surrogate (or is otherwise not valid Unicode)."""
    param = find_unencodable(request)
    if param is not None:
        raise APIError(
            400,
            f"'{param}' is not valid Unicode text: it holds a lone UTF-16 surrogate (such as "
            "\\ud800, half of a surrogate pair); send whole characters",
            param,
            "invalid_text",
        )
