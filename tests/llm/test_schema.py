"""OpenAI request bodies are checked field by field: every malformed body is a 400 that names the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from octacloud.protocols.openai import schema
from octacloud.protocols.openai.errors import answer_of

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def parse(kind: str, body: Any) -> schema.OpenAIRequest:
    return schema.parse(kind, body if isinstance(body, bytes) else json.dumps(body).encode())


def test_a_chat_body_is_read_with_its_defaults() -> None:
    call = parse(schema.CHAT, {**CHAT, "max_completion_tokens": 9, "stream": True})
    assert (call.model, call.stream, call.n, call.max_tokens, call.include_usage) == ("m", True, 1, 9, False)
    assert "model" not in call.body and call.body["max_tokens"] == 9 and "max_completion_tokens" not in call.body


def test_completions_default_to_sixteen_tokens_as_openai_does() -> None:
    call = parse(schema.COMPLETION, {"model": "m", "prompt": "Once"})
    assert call.max_tokens == 16 and call.body["max_tokens"] == 16


def test_the_prompt_bound_counts_utf8_bytes() -> None:
    call = parse(schema.CHAT, {"model": "m", "messages": [{"role": "user", "content": "héllo"}]})
    assert call.prompt_bytes() == 6


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        (schema.CHAT, b"", None),
        (schema.CHAT, b"{", None),
        (schema.CHAT, b"[]", None),
        (schema.CHAT, b"\xff\xfe", None),
        (schema.CHAT, {"messages": CHAT["messages"]}, "model"),
        (schema.CHAT, {"model": 3, "messages": CHAT["messages"]}, "model"),
        (schema.CHAT, {"model": ""}, "messages"),
        (schema.CHAT, {"model": "m", "messages": "hi"}, "messages"),
        (schema.CHAT, {"model": "m", "messages": []}, "messages"),
        (schema.CHAT, {"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        (schema.CHAT, {"model": "m", "messages": [{"role": "user"}]}, "messages[0].content"),
        (schema.CHAT, {"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            schema.CHAT,
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
        (schema.CHAT, {**CHAT, "temperature": "hot"}, "temperature"),
        (schema.CHAT, {**CHAT, "temperature": 5}, "temperature"),
        (schema.CHAT, {**CHAT, "top_p": -0.1}, "top_p"),
        (schema.CHAT, {**CHAT, "n": 0}, "n"),
        (schema.CHAT, {**CHAT, "n": True}, "n"),
        (schema.CHAT, {**CHAT, "max_tokens": -1}, "max_tokens"),
        (schema.CHAT, {**CHAT, "max_tokens": 2.5}, "max_tokens"),
        (schema.CHAT, {**CHAT, "stop": [1, 2]}, "stop"),
        (schema.CHAT, {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        (schema.CHAT, {**CHAT, "seed": "x"}, "seed"),
        (schema.CHAT, {**CHAT, "stream": "yes"}, "stream"),
        (schema.CHAT, {**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
        (schema.CHAT, {**CHAT, "stream": True, "stream_options": {"other": 1}}, "stream_options"),
        (schema.CHAT, {**CHAT, "logit_bias": {"x": 1}}, "logit_bias"),
        (schema.CHAT, {**CHAT, "logit_bias": {"5": 500}}, "logit_bias.5"),
        (schema.CHAT, {**CHAT, "id_slot": 0}, "id_slot"),
        (schema.CHAT, {**CHAT, "temperature": float("nan")}, "temperature"),
        (schema.COMPLETION, {"model": "m"}, "prompt"),
        (schema.COMPLETION, {"model": "m", "prompt": []}, "prompt"),
        (schema.COMPLETION, {"model": "m", "prompt": [1, "a"]}, "prompt"),
        (schema.COMPLETION, {"model": "m", "prompt": [-1]}, "prompt"),
        (schema.EMBEDDING, {"model": "m", "input": {"a": 1}}, "input"),
        (schema.EMBEDDING, {"model": "m", "input": "a", "encoding_format": "hex"}, "encoding_format"),
    ],
)
def test_a_malformed_body_is_a_400_naming_its_field(kind: str, body: Any, param: str | None) -> None:
    with pytest.raises(schema.BadRequest) as caught:
        parse(kind, body)
    status, answer, _ = answer_of(caught.value)
    error = json.loads(answer)["error"]
    assert status == 400
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
