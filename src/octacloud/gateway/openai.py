"""The gateway's generative front: OpenAI's API (``/v1/...``) and Triton's generate extension, streamed.

A request is authorized on its headers (the tenant's key as ``Authorization: Bearer``, so the ``openai`` client
works unmodified), checked whole (``protocols/openai/schema.py``: garbage gets OpenAI's 400 before any replica
is asked), admitted by the tenant's token budget and its concurrent streams (429 with ``Retry-After``), routed
by the body's ``model`` (a deployment the caller may see; others are 404 as unknown ones are) to a ready
replica, and relayed: a stream's events leave as the replica sends them, never buffered. A client that goes
away mid-stream closes the replica's request, which closes the engine's: the generation stops.

Billing reads the answer's ``usage`` (the replica puts it in every answer; in a stream, its last event): the
tenant's prompt and completion tokens are counted per deployment (the meter writes them to the ledger) and
charged to its token budget. A stream cut short is billed what the replica reported up to the cut.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from octacloud.gateway.forward import Unanswered
from octacloud.gateway.routing import DeploymentCounters, Endpoint
from octacloud.metering import Traffic
from octacloud.protocols.asgi import HttpError, content_length
from octacloud.protocols.endpoints import deployment_of, generative_match
from octacloud.protocols.openai import schema
from octacloud.protocols.openai.errors import answer_of, error_body
from octacloud.protocols.rest.request import Http1Request, encode_headers
from octacloud.security.internal_auth import REPLICA_HEADER_BYTES, TENANT_HEADER_BYTES
from octacloud.serving.generate.client import Answer, StreamError, Target, request
from octacloud.serving.generate.sse import EventSplitter, data_of
from octacloud.tenancy import AuthError, Principal, RateLimitedError
from octacloud.tenancy.tokens import GenerationLimits, Hold, OverLimitError

if TYPE_CHECKING:
    from octacloud.gateway.rest import RestGateway
    from octacloud.tenancy.keys import Quota


class Admission(Protocol):
    """Who admits a tenant's generations: :class:`GenerationLimits` in this process, or a gateway worker's
    ``gateway.generations.RemoteGenerationLimits``, which asks the main process."""

    async def ask(self, tenant: str, quota: Quota, estimate: int) -> Hold: ...

    def settle(self, hold: Hold, used: int) -> None: ...


log = logging.getLogger(__name__)

_JSON = encode_headers([(b"content-type", b"application/json")])
_SSE = encode_headers([(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")])
_FORWARDED = frozenset({b"content-type", b"accept", b"user-agent", b"x-request-id", b"traceparent"})
"""The client's headers a replica gets (with the cloud's internal ones): never its key or its connection's."""


def is_generative_path(method: bytes, path: str) -> bool:
    """Whether the path is one of the endpoint table's generative rows (``protocols/endpoints.py``)."""
    return generative_match(method, path) is not None


@dataclass(slots=True)
class Billed:
    """One generation's tokens, counted into the tenant's traffic once, as soon as they are known: before the
    event (or answer) that carries them leaves, so that a client that has its ``usage`` finds it metered."""

    traffic: Traffic
    prompt: int = 0
    completion: int = 0
    committed: bool = False

    def commit(self) -> None:
        if not self.committed and (self.prompt or self.completion):
            self.committed = True
            self.traffic.prompt_tokens += self.prompt
            self.traffic.completion_tokens += self.completion


class OpenAIFront:
    """``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings`` and
    ``/v2/models/<m>/generate[_stream]`` on the gateway's HTTP/1.1 server (see the module docstring)."""

    def __init__(self, gateway: RestGateway, limits: Admission | None = None) -> None:
        self.gateway = gateway
        clock = gateway.guard.keys.clock if gateway.guard is not None else None
        self.limits: Admission = limits or GenerationLimits(clock)

    async def __call__(self, request: Http1Request) -> None:
        endpoint = generative_match(request.method, request.path)
        oip = endpoint is not None and endpoint.api == "generate"
        try:
            if endpoint is None:
                raise HttpError(404, f"no endpoint {request.method.decode()} {request.path}")
            principal = self.gateway.core.authorize(request.headers)
            if endpoint.gateway == "answer":  # the models the caller may see
                self._models(request, principal)
                return
            await self._generate(request, endpoint.name, principal)
        except Exception as exc:
            if request.answered:
                return
            status, body, headers = answer_of(exc)
            if isinstance(exc, AuthError):
                status, body = 401, error_body(401, str(exc))
                headers = [(b"www-authenticate", b'Bearer realm="octacloud"')]
            elif isinstance(exc, RateLimitedError | OverLimitError):
                status, body = 429, error_body(429, str(exc))
                headers = [(b"retry-after", str(exc.retry_after).encode())]
            if oip:
                body = json.dumps({"error": json.loads(body)["error"]["message"]}).encode()
            request.respond(status, _JSON + encode_headers(headers), body, close=not request.complete)

    def _models(self, request: Http1Request, principal: Principal) -> None:
        routes = self.gateway.routes
        guarded = self.gateway.guard is not None
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": owner.tenant}
            for name, owner in sorted(routes.owners.items())
            if not guarded or principal.may_see(owner.tenant, owner.published)
        ]
        request.respond(200, _JSON, json.dumps({"object": "list", "data": data}).encode())

    async def _generate(self, request: Http1Request, target: str, principal: Principal) -> None:
        gateway = self.gateway
        content_length(request.headers, gateway.limits.max_body_bytes)
        wait = gateway.limits.body_timeout_s
        try:
            body = await request.read_body(wait)
        except TimeoutError:
            raise HttpError(408, f"the request body did not arrive within {wait:g} s") from None
        if target.startswith("generate"):
            deployment = deployment_of(request.path)
            estimate, stream = _generate_estimate(body), target == "generate_stream"
        else:
            call = schema.parse(target, body)
            deployment, stream = call.model, call.stream
            estimate = call.prompt_bytes() // 4 + call.requested_tokens()
        unknown = f"The model '{deployment}' does not exist or you do not have access to it."
        counters = gateway.admit(deployment, principal, unknown)
        hold = await self.limits.ask(principal.tenant, principal.quota, estimate)
        traffic = gateway.routes.tenant_traffic(principal.tenant, deployment)
        billed = Billed(traffic)
        endpoint: Endpoint | None = None
        try:
            with gateway.core.flight(counters) as started:
                answer, endpoint = await self._forward(request, deployment, counters, principal, body)
                if answer.status != 200 or not stream:
                    sent = await self._whole(request, answer, billed)
                else:
                    sent = await self._stream(request, answer, billed, counters, started)
                failed, paid = answer.status >= 400, answer.status < 500  # its tokens are in already (Billed.commit)
                gateway.core.settle(counters, traffic, len(body), sent, failed=failed, billed=paid)
        finally:
            if endpoint is not None:
                endpoint.outstanding -= 1
            self.limits.settle(hold, billed.prompt + billed.completion)

    async def _forward(
        self, request: Http1Request, deployment: str, counters: DeploymentCounters, principal: Principal, body: bytes
    ) -> tuple[Answer, Endpoint]:
        """The first replica's answer head and the replica (its ``outstanding`` counts this request until the
        caller's end), up to ``forward.MAX_ATTEMPTS`` replicas tried (only before any answer)."""
        gateway = self.gateway
        headers = [(k, v) for k, v in request.headers if k in _FORWARDED]
        headers += gateway.internal
        headers.append((TENANT_HEADER_BYTES, principal.tenant.encode()))
        path = request.raw_path

        async def ask(endpoint: Endpoint) -> Answer:
            named = [*headers, (REPLICA_HEADER_BYTES, endpoint.replica_id.encode())]
            try:
                return await self._ask(endpoint, path, named, body)
            except StreamError as exc:
                raise Unanswered(str(exc)) from None

        return await gateway.forward(deployment, counters, len(body), ask, hold=True)

    async def _ask(self, endpoint: Endpoint, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> Answer:
        tls = self.gateway.pool.tls
        target = Target(endpoint.host, endpoint.http_port, tls=tls)
        answer = await request(target, b"POST", path, headers, body, head_timeout=self.gateway.request_timeout)
        if answer.status == 421:  # another process has the address: not the replica meant
            answer.close()
            raise StreamError(f"replica {endpoint.replica_id} is not at {endpoint.host}:{endpoint.http_port} any more")
        return answer

    async def _whole(self, request: Http1Request, answer: Answer, billed: Billed) -> int:
        body = await answer.read()
        if answer.status == 200:
            try:
                _usage_into(billed, json.loads(body))
            except ValueError:
                pass
            billed.commit()
        kind = answer.header(b"content-type") or b"application/json"
        request.respond(answer.status, encode_headers([(b"content-type", kind)]), body)
        return len(body)

    async def _stream(
        self, request: Http1Request, answer: Answer, billed: Billed, counters: DeploymentCounters, started: float
    ) -> int:
        """Relay the replica's events as they come; bill from the last event that carries usage; count the time
        to the first event (the deployment's autoscaler reads it). A client gone closes the replica's request at
        once (also while no event is due)."""
        watcher = asyncio.get_running_loop().create_task(request.wait_disconnect())
        watcher.add_done_callback(lambda task: None if task.cancelled() else answer.close())
        splitter = EventSplitter()
        sent = 0
        last = b""
        request.start(200, _SSE, None)
        try:
            async for chunk in answer.chunks():
                for event in splitter.feed(chunk):
                    if b'"usage"' in event:
                        _usage_into(billed, data_of(event))
                        billed.commit()
                    elif b'"timings"' in event:
                        last = event  # read at the end only if no usage comes
                request.write(chunk)
                if not sent:
                    counters.first_tokens += 1
                    counters.first_token_us_total += int((time.perf_counter() - started) * 1e6)
                sent += len(chunk)
        except (StreamError, ValueError) as exc:
            if not request.disconnected:
                log.warning("a stream from a replica broke off: %s", exc)
        finally:
            watcher.cancel()
        if last and not billed.committed:
            _usage_into(billed, data_of(last))
        billed.commit()
        if not request.disconnected:
            request.finish()
        return sent


def _usage_into(billed: Billed, data: Any) -> None:
    """The tokens an answer (or stream event) reports: its ``usage``, else its engine timings (a cut stream)."""
    if not isinstance(data, dict):
        return
    usage = data.get("usage")
    if isinstance(usage, dict):
        billed.prompt = int(usage.get("prompt_tokens", 0) or 0)
        billed.completion = int(usage.get("completion_tokens", 0) or 0)
        return
    timings = data.get("timings")
    if isinstance(timings, dict) and not billed.completion:
        billed.prompt = max(billed.prompt, int(timings.get("prompt_n", 0)) + int(timings.get("cache_n", 0)))
        billed.completion = max(billed.completion, int(timings.get("predicted_n", 0)))


def _generate_estimate(body: bytes) -> int:
    try:
        data = json.loads(body)
        text = data.get("text_input", "") if isinstance(data, dict) else ""
        params = data.get("parameters") or {} if isinstance(data, dict) else {}
        return len(str(text).encode()) // 4 + int(params.get("max_tokens", 16) if isinstance(params, dict) else 16)
    except (ValueError, TypeError, AttributeError):
        return 0
