"""Engine log-probability entries -> the API's shapes: OpenAI chat ``logprobs.content``, the
legacy completions ``logprobs`` object (generated and, with ``echo``, prompt tokens) and vLLM's
``prompt_logprobs`` list.

Engine entries: a generated token's ``(logprob, [(id, logprob)])``
(:data:`~engine.core.outputs.TokenLogprobs`), a prompt token's ``(logprob, rank, [(id,
logprob)])`` (:data:`~engine.core.outputs.PromptLogprob`). With ``return_tokens_as_token_ids``
(vLLM's extension) every token is reported as ``"token_id:<id>"``, so tokens that decode to the
same text (pieces of one UTF-8 character all decode to U+FFFD) stay distinct keys of a
``top_logprobs`` dict. Log-probabilities below -9999 (``-inf`` cannot be written in JSON) are
reported as -9999, as OpenAI and vLLM do.
"""

from __future__ import annotations

from engine.frontend.tokenizer import Tokenizer
from engine.loader.embedded import bytes_to_unicode
from server.protocol import CompletionLogprobs, PromptLogprobValue, TokenLogprob, TopLogprob

#: byte-level BPE: vocabulary character -> byte (GPT-2's table, used by Qwen's tokenizer)
_BYTE_OF_CHAR = {c: b for b, c in bytes_to_unicode().items()}

#: the lowest log-probability reported (JSON has no -inf)
MIN_LOGPROB = -9999.0


def clamp(logprob: float) -> float:
    """``logprob``, no lower than :data:`MIN_LOGPROB` (``-inf`` and NaN become it)."""
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB


class TokenNames:
    """How tokens are written in a response: their decoded text, or ``token_id:<id>``.

    Args:
        tokenizer: decodes ids (special tokens kept: a logprob entry names the exact token).
        as_ids: the request's ``return_tokens_as_token_ids``.
    """

    def __init__(self, tokenizer: Tokenizer, as_ids: bool = False):
        self.tokenizer, self.as_ids = tokenizer, as_ids

    def text(self, token_id: int) -> str:
        """The decoded text of one token (U+FFFD for part of a UTF-8 character)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def name(self, token_id: int) -> str:
        """The token as reported: ``token_id:<id>`` or its decoded text."""
        return f"token_id:{token_id}" if self.as_ids else self.text(token_id)

    def bytes(self, token_id: int, text: str) -> list[int]:
        """The UTF-8 bytes a token stands for. A token holding part of a character decodes to
        U+FFFD alone; its vocabulary string (byte-level form) still gives its real bytes, which
        is what OpenAI's ``bytes`` field is for. Falls back to the decoded text's bytes."""
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece:
            try:
                return [_BYTE_OF_CHAR[c] for c in piece]
            except KeyError:
                pass
        return list(text.encode())


def chat_logprobs(names: TokenNames, token_ids: list[int], entries: list) -> list[TokenLogprob]:
    """OpenAI chat ``logprobs.content`` entries for generated tokens."""
    out = []
    for tok, entry in zip(token_ids, entries):
        if entry is None:
            continue
        lp, alts = entry
        tops = []
        for alt_id, alt_lp in alts:
            text = names.text(alt_id)
            tops.append(
                TopLogprob(
                    token=names.name(alt_id), logprob=clamp(alt_lp), bytes=names.bytes(alt_id, text)
                )
            )
        text = names.text(tok)
        out.append(
            TokenLogprob(
                token=names.name(tok),
                logprob=clamp(lp),
                bytes=names.bytes(tok, text),
                top_logprobs=tops,
            )
        )
    return out


def _top_dict(names: TokenNames, token_id: int, logprob: float, alts, k: int) -> dict:
    """A legacy ``top_logprobs`` entry: the ``k`` most likely tokens and the token itself (so
    up to ``k + 1`` keys, as OpenAI documents). Tokens whose names collide (pieces of a UTF-8
    character all decode to U+FFFD; ``return_tokens_as_token_ids`` avoids it) keep the larger
    logprob, so the dict's maximum is still the most likely token's (lm-eval's greedy test)."""
    top: dict[str, float] = {}
    for i, lp in alts[:k]:
        top.setdefault(names.name(i), clamp(lp))
    top.setdefault(names.name(token_id), clamp(logprob))
    return top


def completion_logprobs(
    names: TokenNames,
    token_ids: list[int],
    entries: list,
    k: int,
    offset: int = 0,
    prompt_ids: list[int] | None = None,
    prompt_entries: list | None = None,
) -> tuple[CompletionLogprobs, int]:
    """The legacy completions ``logprobs`` object, and the ``text_offset`` the token after the
    last one reported would have (offsets advance by each token's decoded length, so a stream
    continues where its previous chunk ended and matches the non-streamed response).

    Args:
        token_ids, entries: the generated tokens and their engine entries.
        k: the request's ``logprobs`` (alternatives per token).
        offset: ``text_offset`` of the first token reported.
        prompt_ids, prompt_entries: with ``echo``: the prompt tokens, reported first, and their
            entries (one per prompt token after the first: the first token has ``None``
            ``token_logprobs`` and ``top_logprobs``, as in OpenAI's legacy API and vLLM).
    """
    out = CompletionLogprobs()

    def add(tok: int, lp: float | None, top: dict | None) -> None:
        nonlocal offset
        out.tokens.append(names.name(tok))
        out.token_logprobs.append(None if lp is None else clamp(lp))
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(names.text(tok))

    if prompt_ids is not None:
        for pos, tok in enumerate(prompt_ids):
            if pos == 0:
                add(tok, None, None)
                continue
            lp, _, alts = prompt_entries[pos - 1]
            add(tok, lp, _top_dict(names, tok, lp, alts, k))
    for tok, e in zip(token_ids, entries):
        if e is None:
            add(tok, None, None)
        else:
            add(tok, e[0], _top_dict(names, tok, e[0], e[1], k))
    return out, offset


def prompt_logprobs_list(
    names: TokenNames, prompt_ids: list[int], entries: list, k: int
) -> list[dict[str, PromptLogprobValue] | None]:
    """vLLM's ``prompt_logprobs``: ``None`` for the first prompt token, then per token a dict
    ``{"<id>": {"logprob", "rank", "decoded_token"}}`` holding the token itself and the ``k``
    most likely tokens (ranks 1..k)."""
    out: list = [None]
    for tok, (lp, rank, alts) in zip(prompt_ids[1:], entries):
        d = {
            str(tok): PromptLogprobValue(
                logprob=clamp(lp), rank=rank, decoded_token=names.name(tok)
            )
        }
        for r, (i, alt_lp) in enumerate(alts[:k], 1):
            d.setdefault(
                str(i),
                PromptLogprobValue(logprob=clamp(alt_lp), rank=r, decoded_token=names.name(i)),
            )
        out.append(d)
    return out
