"""Counting a prompt's tokens with the engine's own tokenizer and chat template, and what its answers mean."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from octacloud.serving.errors import InvalidInputError, ModelExecutionError, ModelNotReadyError
from octacloud.serving.generate.engine import LlamaServer

TEMPLATE_MARGIN = 8
"""Tokens added to the measured template cost, for what a role or a name may add beyond the probe's."""


class EngineRefusedError(InvalidInputError):
    """The engine refused the request as invalid (its 4xx, passed on as 400 with its words)."""


@dataclass(frozen=True, slots=True)
class TemplateCost:
    """What the chat template adds to the messages' own tokens: ``base`` for a one-message chat (with any
    default system prompt and the assistant's opening), ``per_message`` for each further message."""

    base: int
    per_message: int

    def bound(self, messages: int, content_bytes: int) -> int:
        return self.base + self.per_message * max(0, messages - 1) + content_bytes + TEMPLATE_MARGIN


async def measure_template(engine: LlamaServer) -> TemplateCost:
    """Ask the engine once, at load, what its chat template costs."""
    one = await chat_tokens(engine, {"messages": [{"role": "user", "content": ""}]})
    more = [
        await chat_tokens(engine, {"messages": [{"role": "user", "content": ""}, {"role": role, "content": ""}]})
        for role in ("assistant", "user", "system")
    ]
    return TemplateCost(one, max(0, *(m - one for m in more)))


async def chat_tokens(engine: LlamaServer, body: dict[str, Any]) -> int:
    """The tokens of a chat request's prompt: its messages through the model's chat template."""
    status, answer = await engine.call(b"/v1/chat/completions/input_tokens", body)
    if status != 200 or not isinstance(answer, dict) or not isinstance(answer.get("input_tokens"), int):
        raise engine_error(status, answer)
    return int(answer["input_tokens"])


async def text_tokens(engine: LlamaServer, prompt: str | list[int]) -> int:
    """The tokens of a completion prompt (token ids given are counted, with the BOS the engine may add)."""
    if isinstance(prompt, list):
        return len(prompt) + 1
    status, answer = await engine.call(b"/tokenize", {"content": prompt, "add_special": True})
    if status != 200 or not isinstance(answer, dict) or not isinstance(answer.get("tokens"), list):
        raise engine_error(status, answer)
    return len(answer["tokens"])


def engine_error(status: int, answer: object) -> Exception:
    """The serving error for an engine's refusal: its 4xx a 400 with its words, 503 not ready, else 500."""
    message = answer.get("error", {}).get("message") if isinstance(answer, dict) else None
    text = message if isinstance(message, str) else str(answer)[:500]
    if status == 503:
        return ModelNotReadyError(f"the engine is not ready: {text}")
    if 400 <= status < 500:
        return EngineRefusedError(text)
    return ModelExecutionError(f"the engine answered {status}: {text}")
