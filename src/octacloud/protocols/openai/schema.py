"""OpenAI's request bodies, checked field by field before anything is queued.

Every field a body may carry is in one table per endpoint, with its type and range; a body with another field, a
field of the wrong type or out of range is refused with 400 and a message that names the field (OpenAI's own
``param``), never passed on for the engine to choke on. Fields beyond OpenAI's that llama.cpp and vLLM both take
(``top_k``, ``min_p``, ``repeat_penalty``) are accepted too. The gateway and the replica both check: the gateway
to refuse garbage before it costs a replica anything, the replica because it may be called without the gateway.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from octacloud.protocols.endpoints import ENDPOINTS
from octacloud.serving.errors import InvalidInputError

CHAT = "chat"
COMPLETION = "completion"
EMBEDDING = "embedding"
PATHS = {e.path: e.name for e in ENDPOINTS if e.api == "openai" and e.method == "POST" and e.path}
"""The body-checked paths of OpenAI's API, from the endpoint table (its rows are named as the kinds above)."""
COMPLETION_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for ``/v1/completions`` (chat has none: up to the context)."""
MAX_STOP_SEQUENCES = 4
ROLES = ("system", "developer", "user", "assistant", "tool")


class BadRequest(InvalidInputError):
    """A body OpenAI would refuse: 400, with the offending field in ``param``."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


Check = Callable[[str, Any], None]


def _number(low: float, high: float) -> Check:
    def check(name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise BadRequest(f"'{name}' must be a number, got {_show(value)}", name)
        if not low <= value <= high:
            raise BadRequest(f"'{name}' must be between {low:g} and {high:g}, got {value:g}", name)

    return check


def _integer(low: int, high: int = 2**31 - 1) -> Check:
    def check(name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadRequest(f"'{name}' must be an integer, got {_show(value)}", name)
        if not low <= value <= high:
            raise BadRequest(f"'{name}' must be between {low} and {high}, got {value}", name)

    return check


def _kind(kind: type | tuple[type, ...], what: str) -> Check:
    """A value of ``kind`` (a JSON ``true`` is a boolean only, never a number)."""
    wants_bool = kind is bool

    def check(name: str, value: Any) -> None:
        if isinstance(value, bool) != wants_bool or not isinstance(value, kind):
            raise BadRequest(f"'{name}' must be {what}, got {_show(value)}", name)

    return check


def _stop(name: str, value: Any) -> None:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise BadRequest(f"'{name}' must be a non-empty string or a list of them, got {_show(value)}", name)
    if len(items) > MAX_STOP_SEQUENCES:
        raise BadRequest(f"'{name}' may hold at most {MAX_STOP_SEQUENCES} sequences, got {len(items)}", name)


def _stream_options(name: str, value: Any) -> None:
    if not isinstance(value, dict) or set(value) - {"include_usage"}:
        raise BadRequest(f"'{name}' must be an object with only 'include_usage', got {_show(value)}", name)
    if "include_usage" in value and not isinstance(value["include_usage"], bool):
        raise BadRequest(f"'{name}.include_usage' must be a boolean", f"{name}.include_usage")


def _logit_bias(name: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise BadRequest(f"'{name}' must be an object of token id → bias, got {_show(value)}", name)
    for key, bias in value.items():
        if not key.isdigit():
            raise BadRequest(f"'{name}': {key!r} is not a token id", name)
        _number(-100, 100)(f"{name}.{key}", bias)


def _response_format(name: str, value: Any) -> None:
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise BadRequest(f"'{name}' must be an object whose 'type' is text, json_object or json_schema", name)


def _messages(name: str, value: Any) -> None:
    if not isinstance(value, list) or not value:
        raise BadRequest(f"'{name}' must be a non-empty list of messages, got {_show(value)}", name)
    for i, message in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(f"'{where}' must be an object with 'role' and 'content'", where)
        role = message.get("role")
        if role not in ROLES:
            raise BadRequest(f"'{where}.role' must be one of {', '.join(ROLES)}, got {_show(role)}", f"{where}.role")
        extra = set(message) - {"role", "content", "name", "tool_calls", "tool_call_id"}
        if extra:
            raise BadRequest(f"'{where}' has unknown field(s) {sorted(extra)}", where)
        content = message.get("content")
        if content is None and not (role == "assistant" and message.get("tool_calls")):
            raise BadRequest(f"'{where}.content' is required", f"{where}.content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise BadRequest(
                        f"'{where}.content[{j}]' must be a text part ({{'type': 'text', 'text': ...}}); this model "
                        "takes text only",
                        f"{where}.content",
                    )
        elif content is not None and not isinstance(content, str):
            raise BadRequest(f"'{where}.content' must be a string or a list of text parts", f"{where}.content")


def _prompt(name: str, value: Any) -> None:
    if isinstance(value, str):
        return
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value) or _tokens(value):
            return
        if all(isinstance(p, list) and p and _tokens(p) for p in value):
            return
    raise BadRequest(f"'{name}' must be a string, a list of strings, or token ids, got {_show(value)}", name)


def _tokens(values: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in values)


def _encoding_format(name: str, value: Any) -> None:
    if value not in ("float", "base64"):
        raise BadRequest(f"'{name}' must be 'float' or 'base64', got {_show(value)}", name)


_SAMPLING: dict[str, Check] = {
    "max_tokens": _integer(1),
    "temperature": _number(0, 2),
    "top_p": _number(0, 1),
    "n": _integer(1, 128),
    "stop": _stop,
    "seed": _integer(-(2**63), 2**63 - 1),
    "stream": _kind(bool, "a boolean"),
    "stream_options": _stream_options,
    "presence_penalty": _number(-2, 2),
    "frequency_penalty": _number(-2, 2),
    "logit_bias": _logit_bias,
    "user": _kind(str, "a string"),
    "top_k": _integer(0),
    "min_p": _number(0, 1),
    "repeat_penalty": _number(0, 10),
}
FIELDS: dict[str, dict[str, Check]] = {
    CHAT: {
        "model": _kind(str, "a string"),
        "messages": _messages,
        **_SAMPLING,
        "max_completion_tokens": _integer(1),
        "logprobs": _kind(bool, "a boolean"),
        "top_logprobs": _integer(0, 20),
        "response_format": _response_format,
        "tools": _kind(list, "a list"),
        "tool_choice": _kind((str, dict), "a string or an object"),
        "parallel_tool_calls": _kind(bool, "a boolean"),
    },
    COMPLETION: {
        "model": _kind(str, "a string"),
        "prompt": _prompt,
        **_SAMPLING,
        "logprobs": _integer(0, 5),
    },
    EMBEDDING: {
        "model": _kind(str, "a string"),
        "input": _prompt,
        "encoding_format": _encoding_format,
        "dimensions": _integer(1),
        "user": _kind(str, "a string"),
    },
}
REQUIRED = {CHAT: ("model", "messages"), COMPLETION: ("model", "prompt"), EMBEDDING: ("model", "input")}


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """A checked body: what routing, limits and the engine need, and the body itself (``model`` left out)."""

    kind: str
    model: str
    body: dict[str, Any]
    stream: bool
    n: int
    max_tokens: int | None
    """What the caller allows the completion (``None``: up to the context; completions default to 16)."""
    include_usage: bool

    def prompt_bytes(self) -> int:
        """UTF-8 bytes of the prompt's text (a token id counts one): a byte-level BPE tokenizer never makes more
        tokens of a text than it has bytes, so this bounds the prompt's tokens from above."""
        if self.kind == CHAT:
            return sum(_content_bytes(m.get("content")) for m in self.body["messages"])
        value = self.body["prompt" if self.kind == COMPLETION else "input"]
        return _input_bytes(value)

    def requested_tokens(self) -> int:
        """Tokens the caller asked for at most: ``n × max_tokens`` (``None`` counts as 0)."""
        return self.n * (self.max_tokens or 0)


def _content_bytes(content: Any) -> int:
    if isinstance(content, str):
        return len(content.encode())
    if isinstance(content, list):
        return sum(len(p.get("text", "").encode()) for p in content if isinstance(p, dict))
    return 0


def _input_bytes(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, list):
        return sum(_input_bytes(v) if isinstance(v, str | list) else 1 for v in value)
    return 0


def parse(kind: str, raw: bytes) -> OpenAIRequest:
    """The checked request of endpoint ``kind`` (``CHAT``, ``COMPLETION``, ``EMBEDDING``); :class:`BadRequest`."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    fields = FIELDS[kind]
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise BadRequest(f"unrecognized request argument(s) supplied: {', '.join(unknown)}", unknown[0])
    for name in REQUIRED[kind]:
        if body.get(name) is None:
            raise BadRequest(f"'{name}' is a required property", name)
    for name, value in body.items():
        if value is not None:
            fields[name](name, value)
    body = {k: v for k, v in body.items() if v is not None}
    model = body.pop("model")
    if not model:
        raise BadRequest("'model' must name a deployment", "model")
    stream = bool(body.get("stream", False))
    if "stream_options" in body and not stream:
        raise BadRequest("'stream_options' is only allowed when 'stream' is true", "stream_options")
    max_tokens = body.pop("max_completion_tokens", None) if kind == CHAT else None
    max_tokens = body.get("max_tokens", max_tokens)
    if kind == COMPLETION and max_tokens is None:
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
    if max_tokens is not None and kind != EMBEDDING:
        body["max_tokens"] = max_tokens
    include = bool(body.get("stream_options", {}).get("include_usage", False))
    return OpenAIRequest(kind, model, body, stream, int(body.get("n", 1)), max_tokens, include)


def _show(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, str | int | float | bool | type(None)) else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = ["CHAT", "COMPLETION", "EMBEDDING", "PATHS", "BadRequest", "OpenAIRequest", "parse"]
