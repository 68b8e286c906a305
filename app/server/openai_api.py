"""The OpenAI wire format: request bodies in, response objects and stream chunks out.

No HTTP here: the server (app/server/http.py) reads the body, calls ``chat_request`` or
``completion_request``, and builds what it sends with a ``ChatFormat`` or
``CompletionFormat``. Anything a client can get wrong becomes an ``ApiError`` carrying the
status and the message the OpenAI API would give, so a client library reports it as usual.

Fields that would change the answer in ways this server cannot honour (several choices,
tools, log probabilities, JSON mode, presence/frequency penalties) are refused rather than
ignored; fields that change nothing here (``user``, ``n: 1``, a zero penalty, ...) are
accepted, and unknown ones are ignored, as the OpenAI API and other local servers do.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from hybridmoe.backend.text.sampling import SamplingParams
from hybridmoe.backend.errors import UsageError
from hybridmoe.backend.session import Done, Message, Stats

# At most this many stop strings (OpenAI allows 4; some clients send more).
MAX_STOP_STRINGS = 16
# The roles a chat message may have; "developer" is the newer OpenAI name of "system".
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class ApiError(Exception):
    """A request the server answers with an error object: ``{"error": {...}}``."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


# ---- requests --------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationRequest:
    """What both endpoints share: how to sample, and how to answer."""

    sampling: SamplingParams
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the token counts


@dataclass(frozen=True)
class ChatRequest(GenerationRequest):
    messages: tuple[Message, ...] = ()


@dataclass(frozen=True)
class CompletionRequest(GenerationRequest):
    prompt: str = ""


def parse_body(raw: bytes) -> dict:
    """The request body as a JSON object whose every text is Unicode."""
    try:
        # Decoded here: json.loads would guess UTF-16 or UTF-32 from the bytes; JSON over HTTP is UTF-8.
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise bad_request("the request body is not UTF-8 text")
    except json.JSONDecodeError as error:
        raise bad_request(f"the request body is not valid JSON: {error.msg} at line {error.lineno} "
                          f"column {error.colno}")
    except RecursionError:  # the parser recurses once per level of [ or {
        raise bad_request("the request body is nested too deeply: no request of this API nests more than a few "
                          "levels")
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, not {_json_type(body)}")
    _refuse_lone_surrogates(body)
    return body


# A UTF-16 surrogate code point: JSON's "\ud800" escape gives one alone, which is not Unicode.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _refuse_lone_surrogates(body: dict) -> None:
    """A 400 naming the first field whose text holds a lone surrogate.

    JSON lets a string escape half of a UTF-16 surrogate pair ("a\\ud800b"), and Python's parser
    keeps it, but such text cannot be tokenized nor written back as UTF-8. It is refused rather
    than replaced with U+FFFD: it comes from a client that split a pair (a bug the client should
    hear about), and a silently altered prompt would give an answer to something not asked."""
    todo: list[tuple[Any, str]] = [(body, "")]
    while todo:  # without recursion: the nesting depth is the client's to choose
        value, where = todo.pop()
        if isinstance(value, str):
            found = _SURROGATE.search(value)
            if found:
                raise bad_request(f"{where} holds a lone UTF-16 surrogate (\\u{ord(found.group()):04x} at character "
                                  f"{found.start()}), which is not Unicode text: encode the text as UTF-8, or escape "
                                  "both halves of a surrogate pair", where)
        elif isinstance(value, dict):
            for key in value:
                if _SURROGATE.search(key):
                    raise bad_request(f"a key in {where or 'the request body'} holds a lone UTF-16 surrogate, which "
                                      "is not Unicode text", where or None)
            todo.extend((item, f"{where}.{key}" if where else key) for key, item in reversed(value.items()))
        elif isinstance(value, list):
            todo.extend((item, f"{where}[{i}]") for i, item in reversed(list(enumerate(value))))


def chat_request(body: dict, max_tokens_limit: int) -> ChatRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array of {role, content} objects", "messages")
    for name in ("tools", "functions"):
        if body.get(name):
            raise bad_request(f"'{name}' are not supported by this server", name)
    if body.get("logprobs") or body.get("top_logprobs"):
        raise bad_request("log probabilities are not supported by this server", "logprobs")
    response_format = body.get("response_format")
    if response_format is not None and (not isinstance(response_format, dict) or response_format.get("type") != "text"):
        raise bad_request("only the 'text' response format is supported", "response_format")
    parsed = tuple(_message(m, i) for i, m in enumerate(messages))
    limit_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return ChatRequest(
        sampling=_sampling(body, max_tokens_limit, limit_field),
        stream=_boolean(body, "stream"),
        include_usage=_include_usage(body),
        messages=parsed,
    )


def completion_request(body: dict, max_tokens_limit: int) -> CompletionRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # the one-prompt batch some clients send
    if not isinstance(prompt, str):
        raise bad_request("'prompt' must be a string (one prompt per request)", "prompt")
    if not prompt:
        raise bad_request("'prompt' is empty", "prompt")
    if body.get("echo"):
        raise bad_request("'echo' is not supported by this server", "echo")
    if body.get("suffix"):
        raise bad_request("'suffix' (fill in the middle) is not supported by this server", "suffix")
    if body.get("logprobs") is not None:
        raise bad_request("log probabilities are not supported by this server", "logprobs")
    _require_one(body, "best_of")
    return CompletionRequest(
        sampling=_sampling(body, max_tokens_limit, "max_tokens"),
        stream=_boolean(body, "stream"),
        include_usage=_include_usage(body),
        prompt=prompt,
    )


def _message(item: Any, index: int) -> Message:
    where = f"messages[{index}]"
    if not isinstance(item, dict):
        raise bad_request(f"{where} must be an object with 'role' and 'content'", where)
    role = item.get("role")
    if role not in ROLES:
        raise bad_request(f"{where}.role must be one of system, user, assistant (got {_shown(role)})", f"{where}.role")
    if item.get("tool_calls"):
        raise bad_request(f"{where} has tool calls, which this server does not support", f"{where}.tool_calls")
    content = item.get("content")
    if isinstance(content, list):
        content = "\n".join(_text_part(part, f"{where}.content[{i}]") for i, part in enumerate(content))
    if not isinstance(content, str):
        raise bad_request(f"{where}.content must be a string or an array of text parts (got {_json_type(content)})",
                          f"{where}.content")
    return Message(ROLES[role], content)


def _text_part(part: Any, where: str) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        kind = part.get("type") if isinstance(part, dict) else _json_type(part)
        raise bad_request(f"{where}: only text parts are supported (got {_shown(kind)})", where)
    text = part.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{where}.text must be a string", f"{where}.text")
    return text


def _sampling(body: dict, max_tokens_limit: int, limit_field: str) -> SamplingParams:
    _require_one(body, "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, -2.0, 2.0, default=0.0) != 0.0:
            raise bad_request(f"'{name}' is not supported by this server; 'repetition_penalty' is", name)
    max_tokens = _integer(body, limit_field, 1, None)
    if max_tokens is not None and max_tokens > max_tokens_limit:
        raise bad_request(f"'{limit_field}' is {max_tokens}; this server allows at most {max_tokens_limit}",
                          limit_field)
    try:
        return SamplingParams(
            temperature=_number(body, "temperature", 0.0, 2.0, default=1.0),
            top_p=_number(body, "top_p", 0.0, 1.0, default=1.0, above_low=True),
            # Not OpenAI's, but llama.cpp's and vLLM's servers take them too.
            top_k=_integer(body, "top_k", 0, None) or 0,
            min_p=_number(body, "min_p", 0.0, 1.0, default=0.0),
            repetition_penalty=_number(body, "repetition_penalty", 0.0, None, default=1.0, above_low=True),
            seed=_integer(body, "seed", -(2**63), 2**64 - 1),  # what torch takes
            max_tokens=max_tokens or max_tokens_limit,
            stop=_stop(body.get("stop")),
            # Generate through end-of-turn tokens (llama.cpp's and vLLM's servers take it too):
            # what a benchmark needs to get answers of a known length.
            ignore_eos=_boolean(body, "ignore_eos"),
        )
    except UsageError as error:  # a combination SamplingParams refuses
        raise bad_request(error.what)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("'stop' must be a string or an array of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
    return tuple(s for s in stops if s)  # an empty stop string would stop before anything


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    return _boolean(options, "include_usage", param="stream_options.include_usage")


# ---- field readers: the type and the range, or a 400 naming the field --------------------------


def _boolean(body: dict, name: str, *, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"'{param or name}' must be true or false (got {_shown(value)})", param or name)
    return value


def _number(body: dict, name: str, low: float | None, high: float | None, *, default: float,
            above_low: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"'{name}' must be a number (got {_shown(value)})", name)
    too_low = low is not None and (value <= low if above_low else value < low)
    if too_low or (high is not None and value > high):
        bounds = f"{'above' if above_low else 'at least'} {low:g}"
        if high is not None:
            bounds += f" and at most {high:g}"
        raise bad_request(f"'{name}' must be {bounds} (got {value:g})", name)
    return float(value)


def _integer(body: dict, name: str, low: int | None, high: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 100.0 from a client that writes every number as a float
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be a whole number (got {_shown(value)})", name)
    if low is not None and value < low:
        raise bad_request(f"'{name}' must be at least {low} (got {value})", name)
    if high is not None and value > high:
        raise bad_request(f"'{name}' must be at most {high} (got {value})", name)
    return value


def _require_one(body: dict, name: str) -> None:
    value = _integer(body, name, 1, None)
    if value not in (None, 1):
        raise bad_request(f"'{name}' must be 1: this server gives one answer per request", name)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else _json_type(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ---- responses ---------------------------------------------------------------------------------


def finish_reason(done: Done) -> str:
    """OpenAI's finish_reason: "stop" or "length" (a cancelled generation has no reader)."""
    return "length" if done.reason == "length" else "stop"


def usage(stats: Stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens}


class _Format:
    """One response's identity (id, creation time, model) and how its parts are written."""

    prefix = ""
    object_name = ""
    chunk_name = ""

    def __init__(self, model: str):
        self.model = model
        self.id = f"{self.prefix}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def _envelope(self, name: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": name, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def usage_chunk(self, stats: Stats) -> dict:
        return self._envelope(self.chunk_name, [], usage=usage(stats))


class ChatFormat(_Format):
    prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"

    def response(self, done: Done) -> dict:
        message = {"role": "assistant", "content": done.text}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason(done)}
        return self._envelope(self.object_name, [choice], usage=usage(done.stats))

    def opening_chunk(self) -> dict | None:
        return self._chunk({"role": "assistant", "content": ""}, None)

    def text_chunk(self, text: str) -> dict:
        return self._chunk({"content": text}, None)

    def closing_chunk(self, done: Done) -> dict:
        return self._chunk({}, finish_reason(done))

    def _chunk(self, delta: dict, reason: str | None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return self._envelope(self.chunk_name, [choice])


class CompletionFormat(_Format):
    prefix = "cmpl"
    object_name = "text_completion"
    chunk_name = "text_completion"

    def response(self, done: Done) -> dict:
        choice = {"index": 0, "text": done.text, "logprobs": None, "finish_reason": finish_reason(done)}
        return self._envelope(self.object_name, [choice], usage=usage(done.stats))

    def opening_chunk(self) -> dict | None:
        return None  # a completion stream starts with its first text

    def text_chunk(self, text: str) -> dict:
        return self._chunk(text, None)

    def closing_chunk(self, done: Done) -> dict:
        return self._chunk("", finish_reason(done))

    def _chunk(self, text: str, reason: str | None) -> dict:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return self._envelope(self.chunk_name, [choice])
