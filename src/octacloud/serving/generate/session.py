"""One generation request on a replica: checked, sent to the engine, relayed, measured.

:func:`open_generation` holds the model version (so an unload waits for the stream), refuses a request whose
context cannot fit one sequence (400, before it queues: the engine would only find out when a slot frees), and
opens the engine's answer. The :class:`Generation` it returns is read either as events (``stream: true``,
server-sent events relayed one whole event at a time) or whole; either way it counts tokens, time to first
token, inter-token latency and the KV cache the sequences hold, and the engine's ``usage`` is what it reports.
Closing it before the end drops the engine's connection: the engine stops generating for nobody.

The prompt's tokens are bounded without the engine where that settles it: a byte-level BPE tokenizer never
makes more tokens of a text than it has UTF-8 bytes, and the chat template adds at most what was measured at
load (``tokens.TemplateCost``). Only a request near the limit is tokenized by the engine, exactly.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from octacloud.serving.errors import InvalidInputError, ModelExecutionError
from octacloud.serving.generate.client import Answer, StreamError
from octacloud.serving.generate.sse import EventSplitter, data_of
from octacloud.serving.generate.tokens import chat_tokens, engine_error, text_tokens
from octacloud.serving.generate.version import GenerativeVersion

CHAT_PATH = b"/v1/chat/completions"
COMPLETION_PATH = b"/v1/completions"


class ContextLengthError(InvalidInputError):
    """The prompt and the completion asked for do not fit one sequence of the model (400)."""

    code = "context_length_exceeded"


def _prompts(kind: str, body: dict[str, Any]) -> list[str | list[int]]:
    """The completion prompts of a body, one per sequence (before ``n``)."""
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [prompt]
    return list(prompt)


async def check_context(model: GenerativeVersion, kind: str, body: dict[str, Any], max_tokens: int | None) -> int:
    """The prompt's tokens (an upper bound when that settles it, else exact); :class:`ContextLengthError` when
    the longest prompt and ``max_tokens`` (at least one token) do not fit a sequence."""
    limit = model.context_length
    want = max_tokens or 1
    if kind == "chat":
        messages = body["messages"]
        content = sum(_content_bytes(m.get("content")) for m in messages)
        cost = model.template_cost
        tokens = cost.bound(len(messages), content) if cost is not None and "tools" not in body else limit + 1
        if tokens + want > limit:
            tokens = await chat_tokens(model.engine, body)
        where = "messages"
    else:
        tokens = 0
        for prompt in _prompts(kind, body):
            bound = (len(prompt.encode()) + 1) if isinstance(prompt, str) else len(prompt) + 1
            tokens = max(tokens, bound if bound + want <= limit else await text_tokens(model.engine, prompt))
        where = "prompt"
    if tokens + want > limit:
        model.generation.refused_context += 1
        asked = f"{tokens} in the {where}, {max_tokens} in the completion" if max_tokens else f"{tokens} in the {where}"
        raise ContextLengthError(
            f"This model's maximum context length is {limit} tokens. However, you requested {tokens + want} tokens "
            f"({asked}). Please reduce the length of the {where} or of max_tokens."
        )
    return tokens


def _content_bytes(content: Any) -> int:
    if isinstance(content, str):
        return len(content.encode())
    if isinstance(content, list):
        return sum(len(str(p.get("text", "")).encode()) for p in content if isinstance(p, dict))
    return 0


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        total = self.prompt_tokens + self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens, "total_tokens": total}


@dataclass(slots=True)
class _Sequence:
    last_ns: int = 0
    tokens: int = 0


@dataclass(slots=True)
class Generation:
    """An engine answer in flight (see the module docstring). Read it once: :meth:`events` or :meth:`whole`."""

    model: GenerativeVersion
    answer: Answer
    sequences: int
    held_tokens: int
    """KV tokens counted as held for it (its prompts), given back at the end."""
    started_ns: int
    usage: Usage = field(default_factory=Usage)
    first_ns: int = 0
    complete: bool = False
    aborted: bool = False
    _seq: dict[int, _Sequence] = field(default_factory=dict)
    _finished: bool = False
    _timings: dict[str, Any] = field(default_factory=dict)

    async def events(self) -> AsyncIterator[bytes]:
        """The stream's events as they come (each a whole ``data: ...`` event)."""
        splitter = EventSplitter()
        try:
            async for chunk in self.answer.chunks():
                for event in splitter.feed(chunk):
                    data = data_of(event)
                    if isinstance(data, dict):
                        self._observe(data)
                    yield event
            self.complete = True
        except (StreamError, ValueError) as exc:
            if not self.aborted:
                raise ModelExecutionError(f"the engine's stream broke off: {exc}") from None
        finally:
            self.finish()

    def abort(self) -> None:
        """The client went away: drop the engine's request, which stops generating."""
        if not self._finished:
            self.aborted = True
            self.answer.close()

    async def whole(self) -> bytes:
        """A non-streamed answer's body."""
        try:
            body = await self.answer.read()
            data = json.loads(body)
        except (StreamError, ValueError) as exc:
            raise ModelExecutionError(f"the engine's answer broke off: {exc}") from None
        finally:
            self.finish()
        if isinstance(data, dict):
            self._observe_usage(data)
            choices = data.get("choices") or []
            self.usage.completion_tokens = self.usage.completion_tokens or len(choices)
        self.complete = True
        return body

    def _observe(self, data: dict[str, Any]) -> None:
        now = time.perf_counter_ns()
        stats = self.model.generation
        for choice in data.get("choices") or ():
            if not isinstance(choice, dict) or not _has_token(choice):
                continue
            seq = self._seq.setdefault(int(choice.get("index", 0) or 0), _Sequence())
            if not self.first_ns:
                self.first_ns = now
                stats.ttft.observe((now - self.started_ns) / 1e9)
            elif seq.last_ns:
                stats.itl.observe((now - seq.last_ns) / 1e9)
            seq.last_ns = now
            seq.tokens += 1
            stats.kv_tokens += 1
            self.held_tokens += 1
        self._observe_usage(data)

    def _observe_usage(self, data: dict[str, Any]) -> None:
        usage = data.get("usage")
        if isinstance(usage, dict):
            self.usage = Usage(int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)))
        timings = data.get("timings")
        if isinstance(timings, dict):
            self._timings = timings

    def finish(self) -> None:
        """Count it out (once): tokens, latencies, the KV cache it held; drop the engine's connection."""
        if self._finished:
            return
        self._finished = True
        self.answer.close()
        model, stats = self.model, self.model.generation
        now = time.perf_counter_ns()
        if not self.usage.completion_tokens:  # cut off before the usage event: what was relayed
            self.usage.completion_tokens = sum(s.tokens for s in self._seq.values())
            if not self.usage.prompt_tokens and self._timings:
                self.usage.prompt_tokens = int(self._timings.get("prompt_n", 0)) + int(self._timings.get("cache_n", 0))
        stats.running -= self.sequences
        stats.kv_tokens -= self.held_tokens
        stats.prompt_tokens += self.usage.prompt_tokens
        stats.generation_tokens += self.usage.completion_tokens
        stats.e2e.observe((now - self.started_ns) / 1e9)
        if self.first_ns and "prompt_ms" in self._timings:
            waited = (self.first_ns - self.started_ns) / 1e9 - float(self._timings["prompt_ms"]) / 1000
            stats.queue.observe(max(0.0, waited))
        if self.complete:
            stats.requests_finished += 1
        else:
            stats.requests_aborted += 1
        busy = now - (self.first_ns or now)
        model.stats.on_batch(self.sequences, [(self.first_ns or now) - self.started_ns], 0, busy, 0)
        model.stats.on_request(self.complete, now - self.started_ns)
        model.release()


def _has_token(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))
    return bool(choice.get("text"))


async def open_generation(
    model: GenerativeVersion, kind: str, body: dict[str, Any], *, stream: bool, n: int, max_tokens: int | None
) -> Generation:
    """Check and start one request (``kind`` ``chat`` or ``completion``; ``body`` checked by the protocol, its
    ``model`` left out). Raises what the protocol answers: 400 for a context that cannot fit or ``n`` over the
    engine's slots, 503 while the version is not ready."""
    if n > model.args.parallel:
        raise InvalidInputError(
            f"n={n} is more than the {model.args.parallel} sequences this model decodes at once; ask for fewer"
        )
    model.acquire()
    started = time.perf_counter_ns()
    try:
        prompt = await check_context(model, kind, body, max_tokens)
        payload = dict(body)
        if stream:
            payload["stream_options"] = {"include_usage": True}
            payload["timings_per_token"] = True
        answer = await model.engine.open(b"POST", CHAT_PATH if kind == "chat" else COMPLETION_PATH,
                                         json.dumps(payload).encode())  # fmt: skip
        if answer.status != 200:
            refusal = await answer.read()
            try:
                decoded: object = json.loads(refusal)
            except ValueError:
                decoded = refusal.decode(errors="replace")
            raise engine_error(answer.status, decoded)
    except StreamError as exc:
        model.release()
        raise ModelExecutionError(f"the engine did not answer: {exc}") from None
    except BaseException:
        model.release()
        raise
    sequences = n * (len(_prompts(kind, body)) if kind == "completion" else 1)
    model.generation.running += sequences
    model.generation.kv_tokens += prompt * sequences
    return Generation(model, answer, sequences, prompt * sequences, started)
