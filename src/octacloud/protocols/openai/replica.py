"""The replica's generative endpoints on its HTTP/1.1 server: OpenAI's API and Triton's generate extension (the
``openai`` and ``generate`` rows of ``protocols/endpoints.py``): ``GET /v1/models`` (the models this replica
serves), ``POST /v1/chat/completions`` and ``/v1/completions`` (generation; ``stream: true``: server-sent
events), ``POST /v1/embeddings`` (a text model's, MiniLM) and ``POST /v2/models/<m>[/versions/<v>]/generate``,
``.../generate_stream``.

Bodies are checked (``protocols/openai/schema.py``) before the model is asked; errors are OpenAI's JSON shape on
``/v1`` and OIP's ``{"error": ...}`` on ``/v2``. A stream's events leave as the engine makes them, one chunked
write each; a client that goes away mid-stream closes the engine's request, which stops the generation.
Every answer carries ``usage`` (streams: in their last event, as ``stream_options.include_usage`` gives),
which the gateway bills.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from octacloud.protocols.asgi import HttpError, content_length
from octacloud.protocols.endpoints import generative_match
from octacloud.protocols.internal import http_refusal, tenant_of
from octacloud.protocols.openai import schema
from octacloud.protocols.openai.errors import answer_of
from octacloud.protocols.rest.request import Http1Request, encode_headers
from octacloud.serving import DataPlane, InvalidInputError
from octacloud.serving.generate.session import Generation, open_generation
from octacloud.serving.generate.sse import data_of, event

_JSON = encode_headers([(b"content-type", b"application/json")])
_SSE = encode_headers([(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")])
GENERATE_PARAMETERS = {
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "repeat_penalty", "presence_penalty",
    "frequency_penalty", "stream", "exclude_input_in_output",
}  # fmt: skip
"""``parameters`` of a generate request (Triton's vLLM backend takes these as sampling parameters)."""


def generative_target(method: bytes, path: str) -> str | None:
    """Which generative endpoint ``path`` is (``chat``, ``completion``, ``embedding``, ``models``, ``generate``,
    ``generate_stream``: its row's name in ``protocols/endpoints.py``), or None for any other path."""
    endpoint = generative_match(method, path)
    return None if endpoint is None else endpoint.name


class GenerativeHttp1:
    """Answers the paths :func:`generative_target` names, on :class:`~octacloud.protocols.rest.server.Http1Server`."""

    def __init__(
        self, dataplane: DataPlane, *, secret: bytes | None, replica_id: str, max_body_bytes: int, body_timeout_s: float
    ) -> None:
        self.dataplane = dataplane
        self.secret = secret
        self.replica_id = replica_id
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, request: Http1Request, target: str) -> None:
        oip = target.startswith("generate")
        try:
            if self.secret is not None:
                refused = http_refusal(self.secret, self.replica_id, request.path, request.headers)
                if refused is not None:
                    raise HttpError(*refused)
            if target == "models":
                self._models(request)
                return
            content_length(request.headers, self.max_body_bytes)
            try:
                body = await request.read_body(self.body_timeout_s)
            except TimeoutError:
                raise HttpError(408, f"the request body did not arrive within {self.body_timeout_s:g} s") from None
            tenant = tenant_of(request.headers) if self.secret is not None else ""
            if oip:
                await self._generate(request, body, target == "generate_stream")
            elif target == schema.EMBEDDING:
                await self._embeddings(request, schema.parse(target, body), tenant)
            else:
                await self._openai(request, schema.parse(target, body))
        except Exception as exc:  # answered in the endpoint's own error shape
            if request.answered:
                return
            status, answer, headers = answer_of(exc)
            if oip:
                answer = json.dumps({"error": str(exc)}).encode()
            request.respond(status, _JSON + encode_headers(headers), answer, close=not request.complete)

    def _models(self, request: Http1Request) -> None:
        created = int(time.time())
        data = [
            {"id": m.name, "object": "model", "created": created, "owned_by": "octacloud"}
            for m in self.dataplane.repository.loaded()
        ]
        request.respond(200, _JSON, json.dumps({"object": "list", "data": data}).encode())

    async def _openai(self, request: Http1Request, call: schema.OpenAIRequest) -> None:
        model = self.dataplane.generative(call.model)
        generation = await open_generation(
            model, call.kind, call.body, stream=call.stream, n=call.n, max_tokens=call.max_tokens
        )
        if not call.stream:
            request.respond(200, _JSON, await generation.whole())
            return
        await relay(request, generation, generation.events())

    async def _embeddings(self, request: Http1Request, call: schema.OpenAIRequest, tenant: str) -> None:
        value = call.body["input"]
        texts = [value] if isinstance(value, str) else value
        if not all(isinstance(t, str) for t in texts):
            raise schema.BadRequest(f"model {call.model!r} takes text: 'input' must be strings, not token ids", "input")
        vectors, tokens = await self.dataplane.embed(call.model, texts, tenant)
        dimensions = call.body.get("dimensions")
        if dimensions is not None and dimensions != len(vectors[0]):
            raise schema.BadRequest(f"model {call.model!r} makes {len(vectors[0])} dimensions", "dimensions")
        as_base64 = call.body.get("encoding_format") == "base64"
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": base64.b64encode(v.tobytes()).decode() if as_base64 else v.tolist(),
            }
            for i, v in enumerate(vectors)
        ]
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        answer = {"object": "list", "data": data, "model": call.model, "usage": usage}
        request.respond(200, _JSON, json.dumps(answer).encode())

    async def _generate(self, request: Http1Request, raw: bytes, stream: bool) -> None:
        name, version = _generate_route(request.path)
        body = _generate_body(raw, stream)
        model = self.dataplane.generative(name, version)
        call = schema.parse(schema.COMPLETION, json.dumps({"model": name, **body}).encode())
        generation = await open_generation(model, call.kind, call.body, stream=stream, n=1, max_tokens=call.max_tokens)
        head = {"model_name": model.name, "model_version": model.version}
        if not stream:
            answer = json.loads(await generation.whole())
            text = answer["choices"][0]["text"] if answer.get("choices") else ""
            usage = answer.get("usage") or generation.usage.as_dict()
            request.respond(200, _JSON, json.dumps({**head, "text_output": text, "usage": usage}).encode())
            return
        await relay(request, generation, _as_generate(generation, head))


async def _as_generate(generation: Generation, head: dict[str, str]) -> AsyncIterator[bytes]:
    """The engine's completion events as Triton's generate_stream events (``text_output`` per token)."""
    async for raw in generation.events():
        data = data_of(raw)
        if not isinstance(data, dict):
            continue
        choices = data.get("choices") or []
        text = "".join(str(c.get("text", "")) for c in choices if isinstance(c, dict))
        out: dict[str, Any] = {**head, "text_output": text}
        if isinstance(data.get("usage"), dict):
            out["usage"] = data["usage"]
        elif not text:
            continue
        yield event(out)


async def relay(request: Http1Request, generation: Generation, events: AsyncIterator[bytes]) -> None:
    """Write ``events`` as a chunked ``text/event-stream``, each as it comes; stop the generation when the client
    goes away (noticed at once, also while the engine has nothing to send)."""
    watcher = asyncio.get_running_loop().create_task(request.wait_disconnect())
    watcher.add_done_callback(lambda task: None if task.cancelled() else generation.abort())
    request.start(200, _SSE, None)
    try:
        async for chunk in events:
            request.write(chunk)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        generation.finish()
    if not request.disconnected:
        request.finish()


def _generate_route(path: str) -> tuple[str, str]:
    parts = path.strip("/").split("/")  # v2 models <m> [versions <v>] generate[_stream]
    if len(parts) == 6 and parts[3] == "versions":
        return parts[2], parts[4]
    if len(parts) == 4:
        return parts[2], ""
    raise HttpError(404, f"no endpoint POST {path}")


def _generate_body(raw: bytes, stream: bool) -> dict[str, Any]:
    """A generate request (``{"text_input": ..., "parameters": {...}}``) as a completion body."""
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise InvalidInputError(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict) or not isinstance(body.get("text_input"), str):
        raise InvalidInputError("a generate request is a JSON object with a string 'text_input'")
    unknown = sorted(set(body) - {"text_input", "parameters", "id"})
    if unknown:
        raise InvalidInputError(f"unknown field(s) {unknown}: give sampling settings in 'parameters'")
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidInputError("'parameters' must be an object")
    extra = sorted(set(params) - GENERATE_PARAMETERS)
    if extra:
        raise InvalidInputError(f"unknown parameter(s) {extra}; known: {sorted(GENERATE_PARAMETERS)}")
    params = {k: v for k, v in params.items() if k not in ("stream", "exclude_input_in_output")}
    return {"prompt": body["text_input"], **params, "stream": stream}
