"""A tenant's generation limits with one owner, the main process, for every gateway worker.

``tenancy.tokens.GenerationLimits`` counts a tenant's generations in flight (``max_streams``) and its token budget
(``tokens_per_minute``). Kept in each worker, a tenant would get N times both from N workers; so with gateway
workers the main process holds the only one (:class:`GenerationOwner`), and a worker asks it before each
generation of a tenant that has either limit (:class:`RemoteGenerationLimits`): ``admit`` over the feed, answered
``admitted`` or ``over`` (OpenAI's 429, with the owner's ``Retry-After``), and ``settle`` with the tokens the
generation used when it ends. A tenant with neither limit is not asked about: its generations cost no round trip.

The owner keeps what each worker holds. When a worker's feed connection ends (it exited, kill -9 included) the
streams it held come back at once; their estimates stay spent, since what they used is not known. A worker that
gives up waiting for an answer (its client went away, or the owner did not answer within ``ASK_TIMEOUT_S``)
settles an admission that arrives after all, so that no slot is held for a generation that never ran.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from octacloud.gateway.sharing import ShareError, count
from octacloud.protocols.asgi import HttpError
from octacloud.tenancy.keys import Quota
from octacloud.tenancy.tokens import GenerationLimits, Hold, OverLimitError

ASK_TIMEOUT_S = 5.0
"""How long a worker waits for the owner's answer before refusing the generation with 503."""
_RETRY = [(b"retry-after", b"1")]


class GenerationOwner:
    """The main process's side: the one :class:`GenerationLimits`, and each worker's holds in it."""

    def __init__(self, limits: GenerationLimits) -> None:
        self.limits = limits
        self._held: dict[int, dict[int, Hold]] = {}

    def admit(self, worker: int, message: Mapping[str, Any]) -> dict[str, Any]:
        """Answer one ``admit`` of ``worker``; raises ShareError (holding nothing) when it is malformed."""
        ticket = _ticket(message.get("id"))
        tenant = message.get("tenant")
        if not isinstance(tenant, str):
            raise ShareError("admit needs a string tenant")
        quota = Quota(tokens_per_minute=_optional(message, "tpm"), max_streams=_optional(message, "streams"))
        estimate = count(message.get("estimate"), "estimate")
        mine = self._held.setdefault(worker, {})
        if ticket in mine:
            raise ShareError(f"admit {ticket} is already held")
        try:
            hold = self.limits.admit(tenant, quota, estimate)
        except OverLimitError as exc:
            return {"t": "over", "id": ticket, "error": str(exc), "retry_after": exc.retry_after}
        mine[ticket] = hold
        return {"t": "admitted", "id": ticket}

    def settle(self, worker: int, message: Mapping[str, Any]) -> None:
        """One ``settle`` of ``worker``: its generation ended having used ``used`` tokens (an unknown one is
        ignored: it was settled when its worker was found gone)."""
        ticket = _ticket(message.get("id"))
        used = count(message.get("used"), "used")
        hold = self._held.get(worker, {}).pop(ticket, None)
        if hold is not None:
            self.limits.settle(hold, used)

    def gone(self, worker: int) -> None:
        """The worker's connection ended: what it held comes back (its estimates stay spent)."""
        for hold in self._held.pop(worker, {}).values():
            self.limits.settle(hold, hold.tokens)

    def in_flight(self, tenant: str) -> int:
        """The tenant's generations in flight over every worker."""
        return self.limits.streams.get(tenant, 0)


class RemoteGenerationLimits:
    """A worker's side: asks the owner through ``send`` (a feed message); :meth:`answer` takes its answers."""

    def __init__(self, send: Callable[[dict[str, Any]], None], timeout_s: float = ASK_TIMEOUT_S) -> None:
        self._send = send
        self.timeout_s = timeout_s
        self._next = 0
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._abandoned: set[int] = set()

    async def ask(self, tenant: str, quota: Quota, estimate: int) -> Hold:
        """Admit one generation (or raise :class:`OverLimitError`, or HttpError 503 when the owner is silent)."""
        budgeted = quota.tokens_per_minute is not None
        if quota.max_streams is None and not budgeted:
            return Hold(tenant, estimate, False)  # ticket 0: nothing held at the owner
        self._next += 1
        ticket = self._next
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[ticket] = future
        self._send({"t": "admit", "id": ticket, "tenant": tenant, "streams": quota.max_streams,
                    "tpm": quota.tokens_per_minute, "estimate": estimate})  # fmt: skip
        try:
            async with asyncio.timeout(self.timeout_s):
                answer = await future
        except BaseException as exc:
            if self._pending.pop(ticket, None) is not None:
                self._abandoned.add(ticket)  # settled when its answer comes, if admitted
            elif future.done() and not future.cancelled() and future.exception() is None:
                self._release(future.result())  # answered, but this request goes no further
            if isinstance(exc, TimeoutError):
                raise HttpError(503, "the gateway's generation limits did not answer; retry", _RETRY) from None
            raise
        if answer["t"] == "over":
            raise OverLimitError(str(answer.get("error")), _retry_after(answer))
        return Hold(tenant, estimate, budgeted, ticket)

    def settle(self, hold: Hold, used: int) -> None:
        if hold.ticket:
            self._send({"t": "settle", "id": hold.ticket, "used": max(0, used)})

    def answer(self, message: Mapping[str, Any]) -> None:
        """An ``admitted`` or ``over`` from the owner."""
        ticket = message.get("id")
        if not isinstance(ticket, int):
            raise ShareError("an admission's answer needs an integer id")
        future = self._pending.pop(ticket, None)
        if future is not None:
            if not future.done():
                future.set_result(dict(message))
            return
        if ticket in self._abandoned:
            self._abandoned.discard(ticket)
            self._release(message)

    def _release(self, message: Mapping[str, Any]) -> None:
        if message.get("t") == "admitted":
            self._send({"t": "settle", "id": message["id"], "used": 0})

    def close(self) -> None:
        """The feed ended: every request still waiting is refused with 503."""
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(HttpError(503, "the gateway's generation limits are not reachable; retry", _RETRY))


def _ticket(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ShareError(f"an admission's id is a positive integer, got {value!r}")
    return value


def _optional(message: Mapping[str, Any], name: str) -> int | None:
    value = message.get(name)
    return None if value is None else count(value, name)


def _retry_after(answer: Mapping[str, Any]) -> int:
    value = answer.get("retry_after")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1
