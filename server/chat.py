"""POST /v1/chat/completions: template rendering, generation, and response/stream shaping."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from concurrent.futures import Executor

from pydantic import BaseModel

from engine.core.limits import RequestRejected
from engine.frontend.tokenizer import Tokenizer
from server.context import ServerContext
from server.errors import APIError, rejected
from server.generation import EngineError, Generation, engine_error_event
from server.logprobs import TokenNames, chat_logprobs, prompt_logprobs_list
from server.output import ChatOutputProcessor
from server.params import check_stream_options, to_sampling_params
from server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChoiceLogprobs,
    ResponseMessage,
    ResponseToolCall,
    Usage,
    new_id,
)
from server.reasoning import thinking_state
from server.stream import DONE, ChunkWriter
from server.structured_outputs import (
    grammar_from_request,
    tool_call_grammar,
    tool_parameters_grammars,
)
from server.text_check import check_request_text
from server.tool_parser import json_object


def tool_arguments(arguments: str | dict) -> str | dict:
    """An earlier turn's tool-call ``arguments`` for the chat template: the JSON string parsed
    into an object (as vLLM does), so templates that apply ``tojson`` (Qwen2.5) or print
    strings as they are (Qwen3) both render the JSON once; a string that is not a JSON object
    (:func:`server.tool_parser.json_object`: nor one nested past the parser's recursion limit)
    is kept as it is."""
    if isinstance(arguments, str):
        parsed = json_object(arguments)
        return arguments if parsed is None else parsed
    return arguments


def messages_to_dicts(req: ChatCompletionRequest) -> list[dict]:
    """OpenAI messages as the plain dicts a Hugging Face chat template expects."""
    out = []
    for m in req.messages:
        d: dict = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [
                {
                    "id": tc.id,
                    "type": "function",
                    "function": {
                        "name": tc.function.name,
                        "arguments": tool_arguments(tc.function.arguments),
                    },
                }
                for tc in m.tool_calls
            ]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning_content:
            d["reasoning_content"] = m.reasoning_content
        out.append(d)
    return out


#: template variables the endpoint itself sets (passing them again would be a TypeError -> 500)
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def tool_choice_shown(tc) -> str:
    """A ``tool_choice`` as error messages name it: ``'required'`` or ``function 'f'``."""
    return repr(tc) if isinstance(tc, str) or tc is None else f"function {tc.function.name!r}"


def check_tool_choice(req) -> str | None:
    """The function a request's ``tool_choice`` names (None for a string choice or none), checked
    against its ``tools`` (chat completions and ``/tokenize``'s chat form).

    Raises:
        APIError: 400 for "required" or a named function without tools (``tool_choice``), or a
            name that is not among the tools (``tool_choice.function.name``).
    """
    tc = req.tool_choice
    if tc is None or tc in ("auto", "none"):
        return None
    if not req.tools:
        raise APIError(400, f"tool_choice {tool_choice_shown(tc)} needs tools", "tool_choice")
    if isinstance(tc, str):
        return None
    name = tc.function.name
    if name not in {t.function.name for t in req.tools}:
        raise APIError(
            400,
            f"tool_choice names function {name!r}, which is not among the request's tools",
            "tool_choice.function.name",
        )
    return name


def render_prompt(tokenizer: Tokenizer, req: ChatCompletionRequest) -> str:
    """Render the chat template (sandboxed jinja2) for this request.

    Raises:
        APIError: 400 when the template rejects the conversation.
    """
    tools = None
    if req.tools and req.tool_choice != "none":  # required / named: the model is shown the tools
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
    reserved = _RESERVED_TEMPLATE_KWARGS.intersection(req.chat_template_kwargs or {})
    if reserved:
        raise APIError(
            400, f"chat_template_kwargs cannot set {sorted(reserved)}", "chat_template_kwargs"
        )
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(
            400,
            "continue_final_message continues the final message: it needs "
            "add_generation_prompt false",
            "continue_final_message",
        )
    try:
        text = tokenizer.apply_chat_template(
            messages_to_dicts(req),
            tools=tools,
            add_generation_prompt=req.add_generation_prompt,
            **(req.chat_template_kwargs or {}),
        )
    except ValueError as exc:
        if isinstance(exc.__cause__, RecursionError):  # the field nested deepest is named
            fields = {"messages": req.messages, "tools": req.tools or []}
            fields["chat_template_kwargs"] = req.chat_template_kwargs or {}
            param = max(fields, key=lambda name: _nesting(fields[name]))
            raise APIError(
                400, f"{param} holds a value nested too deeply for the chat template", param
            ) from None
        raise APIError(400, f"chat template error: {exc}", "messages") from None
    return continue_final_message(text, req.messages[-1]) if req.continue_final_message else text


def _nesting(value) -> int:
    """How deeply ``value`` nests (pydantic models, dicts, lists, tuples; 0 for a scalar),
    walked without recursion: the values it measures are those too deep to recurse into."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, BaseModel):
            item = dict(item)
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, depth + 1) for v in item)
        else:
            deepest = max(deepest, depth)
    return deepest


#: a conversation of more messages and rendered tools than this, or a request body of more
#: bytes than this, is rendered in the server's template thread: the sandboxed template takes
#: ~20 us a message on the 2-core CPU box (60,000 short messages, a 2.8 MB body within
#: --max-body-bytes: 1.2 s; one tool call's 2.2 MB of arguments: 0.4 s), and inline it would
#: hold every other request's stream (and /health) for that long; below both the thread
#: hand-off (~0.1 ms) costs more than it frees
RENDER_INLINE_ITEMS = 64
RENDER_INLINE_BYTES = 64 << 10


async def render_prompt_async(
    tokenizer: Tokenizer, req: ChatCompletionRequest, pool: Executor, body_bytes: int = 0
) -> str:
    """:func:`render_prompt` off the event loop, on ``pool`` (the server's one template
    thread, :attr:`ServerContext.render_pool`), for a long conversation (more than
    :data:`RENDER_INLINE_ITEMS` messages and rendered tools together) or a large request
    (``body_bytes``, the request body's size, above :data:`RENDER_INLINE_BYTES`). The template
    holds the GIL while it renders, so the event loop is slowed, not stopped: it runs again
    each time the interpreter switches threads (every 5 ms), where inline it waited for the
    whole render (measured: a 60,000-message body held /health 1.5-1.9 s inline, ~0.25 s with
    the render in the thread, the rest being the body's parsing). One thread: the GIL would
    not run two renders at once anyway, and more would slow the event loop more.

    Raises:
        APIError: as :func:`render_prompt`.
    """
    tools = len(req.tools) if req.tools and req.tool_choice != "none" else 0
    if len(req.messages) + tools <= RENDER_INLINE_ITEMS and body_bytes <= RENDER_INLINE_BYTES:
        return render_prompt(tokenizer, req)
    return await asyncio.get_running_loop().run_in_executor(pool, render_prompt, tokenizer, req)


def continue_final_message(text: str, final: ChatMessage) -> str:
    """The rendered conversation ``text`` cut right after the final message's text, so that the
    model continues that message instead of starting a new one (vLLM's
    ``continue_final_message``; transformers' ``apply_chat_template`` cuts the same way): the
    last occurrence of the message's text without its surrounding white space, followed by
    the message's trailing white space where the template kept it.

    Raises:
        APIError: 400 naming ``continue_final_message`` when the final message has no text or
            the template does not show it verbatim.
    """
    content = final.text() or ""
    core = content.strip()
    if not core:
        raise APIError(
            400, "continue_final_message needs a final message with text", "continue_final_message"
        )
    at = text.rfind(core)
    if at < 0:
        raise APIError(
            400,
            "continue_final_message: the chat template does not show the final message's text "
            "as it is, so it cannot be continued",
            "continue_final_message",
        )
    end = at + len(core)
    trailing = content[len(content.rstrip()) :]
    if trailing and text.startswith(trailing, end):
        end += len(trailing)
    return text[:end]


class ChatCompletions:
    """The chat endpoint's logic, bound to a :class:`ServerContext`."""

    def __init__(self, ctx: ServerContext):
        self.ctx = ctx

    async def start(self, req: ChatCompletionRequest, body_bytes: int = 0) -> Generation:
        """Validate, render and tokenize, then queue the request's choices. ``body_bytes``: the
        request body's size (0: unknown), which picks where the template renders
        (:func:`render_prompt_async`).

        Raises:
            APIError: 400/404 with an OpenAI error body.
        """
        ctx = self.ctx
        check_request_text(req)
        ctx.check_model(req.model)
        check_stream_options(req)
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
        if req.echo:
            raise APIError(
                400,
                "echo is not supported on chat completions (use prompt_logprobs to score the "
                "prompt, or /v1/completions with echo)",
                "echo",
            )
        if req.stream and req.prompt_logprobs is not None:
            raise APIError(
                400, "prompt_logprobs are not available when stream is true", "prompt_logprobs"
            )
        grammar, param = grammar_from_request(req)
        tools_grammar = self._tool_grammar(req)
        if tools_grammar is not None:
            if grammar is not None:
                shown = tool_choice_shown(req.tool_choice)
                raise APIError(
                    400, f"tool_choice {shown} cannot be combined with {param}", "tool_choice"
                )
            for tool_grammar, tool_param in tool_parameters_grammars(
                req.tools, self._named_function(req)
            ):
                await ctx.structured_output(tool_grammar, tool_param)
            grammar, param = tools_grammar, "tool_choice"
        prompt = await render_prompt_async(ctx.tokenizer, req, ctx.render_pool, body_bytes)
        prompt_ids = await ctx.encode_request_prompt(prompt, "messages", req.add_special_tokens)
        ctx.check_prompt_length(len(prompt_ids), "messages")
        thinking = thinking_state(prompt, req.continue_final_message)
        start_after = None
        if grammar is not None and ctx.reasoning_parser == "qwen3" and thinking != "after":
            start_after = ctx.tokenizer.token_to_id("</think>")  # thinking on: constrain the answer
        spec = await ctx.structured_output(grammar, param, start_after)
        params = to_sampling_params(
            req,
            max_tokens=req.max_completion_tokens or req.max_tokens,
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            prompt_logprobs=req.prompt_logprobs,
            num_prompt_tokens=len(prompt_ids),
            max_model_len=ctx.max_model_len,
            vocab_size=ctx.vocab_size,
            defaults=ctx.defaults,
            max_tokens_param="max_completion_tokens" if req.max_completion_tokens else "max_tokens",
        )
        params.structured_output = spec
        try:
            gen = Generation(
                ctx.engine,
                ctx.tokenizer,
                new_id("chatcmpl"),
                prompt_ids,
                params,
                req.n,
                on_finished=ctx.request_finished,
                on_tokens=ctx.metrics.count_tokens,
            )
            gen.prompt_opens_thinking = thinking == "inside"
            return gen
        except RequestRejected as exc:
            raise rejected(exc, "messages") from None

    def _tool_grammar(self, req: ChatCompletionRequest) -> str | None:
        """The grammar of enforced tool calls (``tool_choice`` "required" or a named function),
        or None ("auto", "none", unset).

        Raises:
            APIError: 400 for "required" or a named function without tools, or an unknown name.
        """
        if req.tool_choice is None or req.tool_choice in ("auto", "none"):
            return None
        name = check_tool_choice(req)
        tok = self.ctx.tokenizer
        special = {tag: tag in tok.added_tokens for tag in ("<tool_call>", "</tool_call>")}
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        return tool_call_grammar(tools, name, req.parallel_tool_calls and name is None, special)

    @staticmethod
    def _named_function(req: ChatCompletionRequest) -> str | None:
        """The function ``tool_choice`` names, or None ("required": any of the tools)."""
        tc = req.tool_choice
        return None if tc is None or isinstance(tc, str) else tc.function.name

    @classmethod
    def _finish_reason(cls, req: ChatCompletionRequest, called: bool, finish: str) -> str:
        """OpenAI's ``finish_reason`` for a choice that ended with ``finish``: "tool_calls"
        where the model called a tool and stopped by itself with ``tool_choice`` "auto" or
        "required"; a named function (``tool_choice: {"type": "function", ...}``) keeps "stop",
        as OpenAI answers (and vLLM since vllm-project/vllm#25054), streamed or not."""
        if called and finish == "stop" and cls._named_function(req) is None:
            return "tool_calls"
        return finish

    def _processor(self, req: ChatCompletionRequest, gen: Generation) -> ChatOutputProcessor:
        return ChatOutputProcessor(
            reasoning=self.ctx.reasoning_parser == "qwen3",
            tools=bool(req.tools) and req.tool_choice != "none",
            in_reasoning=gen.prompt_opens_thinking,
            max_tool_calls=None if req.parallel_tool_calls else 1,
        )

    async def complete(self, req: ChatCompletionRequest, gen: Generation) -> ChatCompletionResponse:
        """Non-streamed response. Raises EngineError when the engine failed the request."""
        results = await gen.collect()
        names = TokenNames(self.ctx.tokenizer, req.return_tokens_as_token_ids)
        choices = []
        for r in results:
            proc = self._processor(req, gen)
            r1, c1, t1 = proc.feed(r.text)
            r2, c2, t2 = proc.finish()
            reasoning, content, calls = r1 + r2, c1 + c2, t1 + t2
            finish = self._finish_reason(req, bool(calls), r.finish_reason)
            msg = ResponseMessage(
                content=content if (content or not calls) else None,
                reasoning_content=(reasoning or None) if req.include_reasoning else None,
                tool_calls=[ResponseToolCall(id=c["id"], function=c["function"]) for c in calls]
                or None,
            )
            lps = None
            if req.logprobs:
                lps = ChoiceLogprobs(content=chat_logprobs(names, r.token_ids, r.logprobs))
            choices.append(
                ChatChoice(
                    index=r.index,
                    message=msg,
                    logprobs=lps,
                    finish_reason=finish,
                    stop_reason=r.stop_reason,
                )
            )
        completion = sum(len(r.token_ids) for r in results)
        rid = gen.request_id
        prompt_lps = None
        if req.prompt_logprobs is not None:  # the same prompt for every choice: the first's
            entries = results[0].prompt_logprobs
            if entries is None or len(entries) != gen.num_prompt_tokens - 1:
                raise EngineError("the engine returned no prompt log-probabilities")
            prompt_lps = prompt_logprobs_list(names, gen.prompt_ids, entries, req.prompt_logprobs)
        return ChatCompletionResponse(
            id=rid,
            model=self.ctx.model_name,
            choices=choices,
            prompt_logprobs=prompt_lps,
            usage=Usage(
                prompt_tokens=gen.num_prompt_tokens,
                completion_tokens=completion,
                total_tokens=gen.num_prompt_tokens + completion,
            ),
        )

    async def stream(self, req: ChatCompletionRequest, gen: Generation) -> AsyncIterator[str]:
        """SSE chunks: role first, content deltas, a finish chunk per choice, usage, [DONE]."""
        rid = gen.request_id
        created = int(time.time())
        model = self.ctx.model_name
        n = len(gen.streams)
        procs = [self._processor(req, gen) for _ in range(n)]
        completion = 0

        writer = ChunkWriter(rid, "chat.completion.chunk", created, model)
        names = TokenNames(self.ctx.tokenizer, req.return_tokens_as_token_ids)

        def chunk(
            index: int, delta: dict, finish: str | None = None, logprobs=None, stop_reason=None
        ) -> str:
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            if finish is not None:  # vLLM's stop_reason, on the finish chunk
                choice["stop_reason"] = stop_reason
            if logprobs is not None:
                choice["logprobs"] = logprobs.model_dump(exclude_none=True)
            return writer.choice(choice)

        for i in range(n):
            yield chunk(i, {"role": "assistant", "content": ""})
        try:
            async for ev in gen.events():
                completion += len(ev.token_ids)
                proc = procs[ev.index]
                r, c, calls = proc.feed(ev.text)
                if ev.finish_reason is not None:
                    r2, c2, calls2 = proc.finish()
                    r, c, calls = r + r2, c + c2, calls + calls2
                if not req.include_reasoning:
                    r = ""
                lps = None
                if req.logprobs and ev.logprobs:
                    lps = ChoiceLogprobs(content=chat_logprobs(names, ev.token_ids, ev.logprobs))
                if r or c or calls or lps:
                    delta: dict = {}
                    if c:
                        delta["content"] = c
                    if r:
                        delta["reasoning_content"] = r
                    if calls:
                        delta["tool_calls"] = [
                            {
                                "index": tc["index"],
                                "id": tc["id"],
                                "type": "function",
                                "function": tc["function"],
                            }
                            for tc in calls
                        ]
                    yield chunk(ev.index, delta, logprobs=lps)
                if ev.finish_reason is not None:
                    finish = self._finish_reason(req, proc.num_tool_calls > 0, ev.finish_reason)
                    yield chunk(ev.index, {}, finish, stop_reason=ev.stop_reason)
        except EngineError as exc:
            yield engine_error_event(exc)
            yield DONE
            return
        if req.stream_options is not None and req.stream_options.include_usage:
            yield writer.usage(
                {
                    "prompt_tokens": gen.num_prompt_tokens,
                    "completion_tokens": completion,
                    "total_tokens": gen.num_prompt_tokens + completion,
                }
            )
        yield DONE
