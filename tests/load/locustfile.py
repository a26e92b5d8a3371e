"""Locust load test for qwen-serve: streamed chat completions, with TTFT and ITL as own entries.

Each user sends ``POST /v1/chat/completions`` with ``"stream": true`` and a prompt drawn from a
short / medium / long mix, reads the server-sent events to the end, and reports:

* ``POST /v1/chat/completions`` -- one entry per request; its response time is the full stream
  (request sent until ``data: [DONE]``), its length the bytes read.
* ``SSE TTFT`` -- time from sending the request to the first event that carries output
  (content, reasoning_content or tool_calls; if none does, the event with the finish_reason).
* ``SSE ITL`` -- the gap between consecutive output-carrying events, one sample per gap.

A request fails on: an HTTP status other than 200, a Content-Type other than text/event-stream,
a malformed SSE line, a stream that ends inside an event, a data payload that is not a JSON
object of a chat.completion.chunk (or carries "error"), data after ``[DONE]``, no ``[DONE]``,
no finish_reason, or a transport error / timeout. TTFT and ITL are reported for successful
requests only.

Configuration (environment):
  QWEN_SERVE_MODEL_NAME           model to request; default: the first id of GET /v1/models
  QWEN_SERVE_API_KEY              sent as "Authorization: Bearer ..." when set
  QWEN_LOCUST_MAX_TOKENS          max_tokens per request (16)
  QWEN_LOCUST_PROMPT_MIX          weights "short:5,medium:3,long:2"
  QWEN_LOCUST_SHORT_WORDS / QWEN_LOCUST_MEDIUM_WORDS / QWEN_LOCUST_LONG_WORDS
                                  prompt lengths in words (8 / 96 / 384; about 1.2 tokens a word)
  QWEN_LOCUST_TEMPERATURE         sampling temperature (0.7)
  QWEN_LOCUST_WAIT_MIN / QWEN_LOCUST_WAIT_MAX
                                  think time between a user's requests in seconds (0.05 / 0.25)
  QWEN_LOCUST_TIMEOUT_S           connect/read timeout of one request (120)
  QWEN_LOCUST_WAIT_FOR_SERVER_S   at start-up, wait up to this long for GET /health == 200 (60)

Run (server on localhost:8000):
  .venv/bin/locust -f tests/load/locustfile.py --host http://127.0.0.1:8000 \
      --headless -u 10 -r 5 -t 1m --stop-timeout 30
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
import urllib.error
import urllib.request

from locust import HttpUser, between, events, task

CHAT_PATH = "/v1/chat/completions"
SSE_TYPE = "SSE"
TTFT_NAME = "TTFT"
ITL_NAME = "ITL"
CHUNK_OBJECT = "chat.completion.chunk"

log = logging.getLogger("qwen_serve.locust")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    return int(value) if value else default


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name, "").strip()
    return float(value) if value else default


MAX_TOKENS = _env_int("QWEN_LOCUST_MAX_TOKENS", 16)
TEMPERATURE = _env_float("QWEN_LOCUST_TEMPERATURE", 0.7)
TIMEOUT_S = _env_float("QWEN_LOCUST_TIMEOUT_S", 120.0)
WAIT_FOR_SERVER_S = _env_float("QWEN_LOCUST_WAIT_FOR_SERVER_S", 60.0)
WAIT_MIN = _env_float("QWEN_LOCUST_WAIT_MIN", 0.05)
WAIT_MAX = _env_float("QWEN_LOCUST_WAIT_MAX", 0.25)
API_KEY = os.environ.get("QWEN_SERVE_API_KEY", "").strip() or None

PROMPT_WORDS = {
    "short": _env_int("QWEN_LOCUST_SHORT_WORDS", 8),
    "medium": _env_int("QWEN_LOCUST_MEDIUM_WORDS", 96),
    "long": _env_int("QWEN_LOCUST_LONG_WORDS", 384),
}


def _parse_mix(text: str) -> tuple[list[str], list[float]]:
    kinds, weights = [], []
    for part in text.split(","):
        if not part.strip():
            continue
        kind, _, weight = part.partition(":")
        kind = kind.strip()
        if kind not in PROMPT_WORDS:
            raise ValueError(f"QWEN_LOCUST_PROMPT_MIX: unknown prompt kind {kind!r}")
        kinds.append(kind)
        weights.append(float(weight) if weight.strip() else 1.0)
    if not kinds or sum(weights) <= 0:
        raise ValueError("QWEN_LOCUST_PROMPT_MIX: no positive weight")
    return kinds, weights


PROMPT_KINDS, PROMPT_WEIGHTS = _parse_mix(
    os.environ.get("QWEN_LOCUST_PROMPT_MIX", "short:5,medium:3,long:2")
)

# Common English words: about one token each for the Qwen tokenizer.
_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this from have "
    "or by one had not but what all were when we there can an your which their said if do will "
    "each about how up out them then she many some so these would other into has more her two "
    "like him see time could no make than first been its who now people my made over did down "
    "only way find use may water long little very after words called just where most know get "
    "through back much go good new write our me man too any day same right look think also "
    "around another came come work three word must because does part even place well such here "
    "take why things help put years different away again off went old number great tell men say "
    "small every found still between name should home big give air line set own under read last "
    "never us left end along while might next sound below saw something thought both few those "
    "always looked show large often together asked house world going want school important until "
    "form food keep children feet land side without boy once animals life enough took sometimes "
    "four head above kind began almost live page got earth need far hand high year mother light "
    "country father let night picture being study second soon story since white ever paper hard "
    "near sentence better best across during today however sure knew try told young sun thing "
    "whole hear example heard several change answer room sea against top turned learn point city "
    "play toward five using usually"
).split()

# Model id shared by all users of this process: env, else resolved from GET /v1/models.
_model = {"name": os.environ.get("QWEN_SERVE_MODEL_NAME", "").strip() or None}


def _auth_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"} if API_KEY else {}


def _get(url: str, timeout: float) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=_auth_headers())
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _wait_for_health(host: str, wait_s: float) -> bool:
    deadline = time.monotonic() + max(wait_s, 0.0)
    last_error = ""
    while True:
        try:
            status, _ = _get(host.rstrip("/") + "/health", timeout=5)
            if status == 200:
                return True
            last_error = f"HTTP {status}"
        except OSError as exc:
            last_error = repr(exc)
        if time.monotonic() >= deadline:
            log.warning("%s/health not ready after %.0f s (%s)", host, wait_s, last_error)
            return False
        time.sleep(1.0)


def _resolve_model(host: str | None) -> str:
    """The model id to request: QWEN_SERVE_MODEL_NAME, else the first id of GET /v1/models."""
    if _model["name"] is None and host:
        try:
            status, body = _get(host.rstrip("/") + "/v1/models", timeout=10)
            if status == 200:
                _model["name"] = json.loads(body)["data"][0]["id"]
                log.info("model from %s/v1/models: %s", host, _model["name"])
            else:
                log.error("GET %s/v1/models: HTTP %s %s", host, status, body[:200])
        except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
            log.error("GET %s/v1/models failed: %r", host, exc)
    return _model["name"] or "default"


@events.init.add_listener
def _on_init(environment, **_kwargs):
    # Blocks start-up (not the measured run) until the server answers, then fixes the model.
    if environment.host:
        if _wait_for_health(environment.host, WAIT_FOR_SERVER_S):
            _resolve_model(environment.host)


@events.test_start.add_listener
def _on_test_start(environment, **_kwargs):
    # The web UI may set the host only now.
    if _model["name"] is None and environment.host:
        _resolve_model(environment.host)


def make_prompt(kind: str, rng: random.Random) -> str:
    words = rng.choices(_WORDS, k=PROMPT_WORDS[kind])
    return (
        f"Request {rng.getrandbits(32):08x} ({kind}). Read the notes and continue them: "
        + " ".join(words)
    )


class StreamError(Exception):
    """The response broke the streaming protocol; the message says how."""


class SSEStreamReader:
    """Checks a chat-completion event stream and times its events.

    Feed it the raw bytes as they arrive (`feed`), then call `finish`. Lines end in LF (a CR
    before it is dropped); an empty line ends an event; lines starting with ":" are comments;
    fields other than data/event/id/retry are malformed.
    """

    def __init__(self, start: float):
        self.start = start
        self.buffer = b""
        self.data_lines: list[str] | None = None
        self.done = False
        self.finish_reasons: list[str] = []
        self.output_times: list[float] = []
        self.finish_time: float | None = None
        self.num_events = 0

    def feed(self, data: bytes, now: float) -> None:
        self.buffer += data
        while True:
            newline = self.buffer.find(b"\n")
            if newline < 0:
                return
            raw, self.buffer = self.buffer[:newline], self.buffer[newline + 1 :]
            if raw.endswith(b"\r"):
                raw = raw[:-1]
            self._line(raw, now)

    def _line(self, raw: bytes, now: float) -> None:
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise StreamError(f"malformed SSE line (not UTF-8): {raw[:80]!r}") from exc
        if line == "":
            if self.data_lines is not None:
                payload = "\n".join(self.data_lines)
                self.data_lines = None
                self._event(payload, now)
            return
        if line.startswith(":"):
            return  # comment / keep-alive
        field, sep, value = line.partition(":")
        if not sep:
            raise StreamError(f"malformed SSE line: {line[:80]!r}")
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            if self.data_lines is None:
                self.data_lines = []
            self.data_lines.append(value)
        elif field not in ("event", "id", "retry"):
            raise StreamError(f"malformed SSE line: {line[:80]!r}")

    def _event(self, payload: str, now: float) -> None:
        self.num_events += 1
        if self.done:
            raise StreamError(f"data after [DONE]: {payload[:80]!r}")
        if payload == "[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(payload)
        except ValueError as exc:
            raise StreamError(f"malformed JSON in SSE data: {payload[:80]!r}") from exc
        if not isinstance(chunk, dict):
            raise StreamError(f"SSE data is not a JSON object: {payload[:80]!r}")
        if "error" in chunk:
            raise StreamError(f"error event: {json.dumps(chunk['error'])[:200]}")
        if chunk.get("object") != CHUNK_OBJECT:
            raise StreamError(f"object is {chunk.get('object')!r}, not {CHUNK_OBJECT!r}")
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            raise StreamError(f"chunk without a choices list: {payload[:80]!r}")
        has_output = False
        for choice in choices:
            if not isinstance(choice, dict):
                raise StreamError(f"choice is not an object: {payload[:80]!r}")
            delta = choice.get("delta") or {}
            if not isinstance(delta, dict):
                raise StreamError(f"delta is not an object: {payload[:80]!r}")
            if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
                has_output = True
            if choice.get("finish_reason") is not None:
                self.finish_reasons.append(choice["finish_reason"])
                if self.finish_time is None:
                    self.finish_time = now
        if has_output:
            self.output_times.append(now)

    def finish(self) -> None:
        if self.buffer or self.data_lines is not None:
            raise StreamError("stream ended inside an SSE event")
        if not self.done:
            raise StreamError("stream ended without data: [DONE]")
        if not self.finish_reasons:
            raise StreamError("stream had no finish_reason")

    @property
    def ttft(self) -> float | None:
        first = self.output_times[0] if self.output_times else self.finish_time
        return None if first is None else first - self.start

    @property
    def itls(self) -> list[float]:
        t = self.output_times
        return [b - a for a, b in zip(t, t[1:])]


class ChatStreamUser(HttpUser):
    """Streams chat completions back to back, with a short think time between requests."""

    wait_time = between(WAIT_MIN, WAIT_MAX)

    def on_start(self):
        self.rng = random.Random()
        self.model = _resolve_model(self.host)

    @task
    def stream_chat(self):
        kind = self.rng.choices(PROMPT_KINDS, PROMPT_WEIGHTS)[0]
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": make_prompt(kind, self.rng)}],
            "stream": True,
            "max_tokens": MAX_TOKENS,
            "temperature": TEMPERATURE,
        }
        start = time.perf_counter()
        reader = SSEStreamReader(start)
        nbytes = 0
        error: str | None = None
        with self.client.post(
            CHAT_PATH,
            json=body,
            headers={"Accept": "text/event-stream", **_auth_headers()},
            stream=True,
            catch_response=True,
            name=CHAT_PATH,
            timeout=TIMEOUT_S,
        ) as response:
            try:
                if response.status_code != 200:
                    text = (response.content or b"")[:300].decode("utf-8", "replace")
                    reason = getattr(response, "error", None) or text
                    raise StreamError(f"HTTP {response.status_code}: {reason}")
                content_type = response.headers.get("Content-Type", "")
                if not content_type.startswith("text/event-stream"):
                    raise StreamError(f"Content-Type {content_type!r}, not text/event-stream")
                for data in response.iter_content(chunk_size=None):
                    nbytes += len(data)
                    reader.feed(data, time.perf_counter())
                reader.finish()
            except StreamError as exc:
                error = str(exc)
            except Exception as exc:  # transport errors, timeouts, broken chunked encoding
                error = f"{type(exc).__name__}: {exc}"
            finally:
                response.close()
            elapsed = time.perf_counter() - start
            meta = getattr(response, "request_meta", None)
            if isinstance(meta, dict):  # report the whole stream, not just the headers
                meta["response_time"] = elapsed * 1000.0
                meta["response_length"] = nbytes
            if error is not None:
                response.failure(error)
                return
            response.success()
        fire = self.environment.events.request.fire
        ttft = reader.ttft
        if ttft is not None:
            fire(
                request_type=SSE_TYPE,
                name=TTFT_NAME,
                response_time=ttft * 1000.0,
                response_length=0,
                exception=None,
                context={},
            )
        for gap in reader.itls:
            fire(
                request_type=SSE_TYPE,
                name=ITL_NAME,
                response_time=gap * 1000.0,
                response_length=0,
                exception=None,
                context={},
            )
