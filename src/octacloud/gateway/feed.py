"""The channel between the main process and its gateway workers: one Unix socket, one JSON object per line.

The main process listens on a socket in its state directory (mode 0600); each worker connects and must first
say ``{"t": "hello", "secret": <the cloud's internal secret>, "worker": i, "pid": p}`` within
``HELLO_TIMEOUT_S``; anything else (a wrong secret, not JSON, a line over ``MAX_LINE``) is answered with
``{"t": "refused", "error": ...}`` and the connection is closed. Then:

- main → worker: ``snapshot`` (the route table, at once and then whenever it changes: the hub compares a fresh
  snapshot every ``poll_s``), ``shares`` (the worker's fractions of the tenants' rate limits, rebalanced every
  ``rebalance_s``, and what the other workers have in flight at each deployment; at once and then whenever it
  changed; see ``gateway.sharing``), ``admitted`` / ``over`` (the answer to an ``admit``), ``readmit`` (a
  replica the controller found ready that a worker said it ejected: its ejection ends at every worker),
  ``forget`` (a key revoked, a tenant disabled or its quota changed: every worker drops its cached verification
  at once), ``ready`` (the controller loop's readiness, every ``heartbeat_s``);
- worker → main: ``serving`` (its fronts listen), ``counters`` (what it counted since its last push, every
  ``push_s``; see ``gateway.sharing``), ``demand`` (the requests each rate-limited tenant sent it since its last
  push, admitted or not), ``admit`` and ``settle`` (a generation of a tenant with generation limits, before it
  starts and when it ends: the main process holds those limits for every worker; see ``gateway.generations``),
  ``ejected`` (it ejected a replica's endpoint after failures in a row).

A worker that stops hearing from the main process for ``stale_s`` reports not ready; one whose connection
ends exits (its supervisor, in the main process, starts a new one).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from octacloud.gateway.generations import GenerationOwner, RemoteGenerationLimits
from octacloud.gateway.routing import RouteTable
from octacloud.gateway.sharing import (
    CounterMerger,
    CounterTracker,
    DemandShares,
    SharedRateLimiter,
    ShareError,
    apply_snapshot,
    parse_levels,
    route_snapshot,
)
from octacloud.security import internal_auth
from octacloud.tenancy.tokens import GenerationLimits

log = logging.getLogger(__name__)

MAX_LINE = 16 * 2**20
HELLO_TIMEOUT_S = 5.0
MAX_BUFFERED = 64 * 2**20
"""A worker that lets this much of the feed pile up unread is cut off (it is restarted)."""


def _line(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def _parse(line: bytes) -> dict[str, Any]:
    try:
        message = json.loads(line)
    except ValueError as exc:
        raise ShareError(f"not JSON: {exc}") from None
    if not isinstance(message, dict) or not isinstance(message.get("t"), str):
        raise ShareError('a message is a JSON object with a string "t"')
    return message


class _Worker:
    def __init__(self, index: int, pid: int, writer: asyncio.StreamWriter) -> None:
        self.index = index
        self.pid = pid
        self.writer = writer
        self.ports: tuple[int, int] | None = None
        self.key = index * 2**32 + pid
        self.shares: dict[str, Any] | None = None
        """The ``shares`` last sent to it."""

    def send(self, data: bytes) -> None:
        if self.writer.is_closing():
            return
        if self.writer.transport.get_write_buffer_size() > MAX_BUFFERED:
            log.error("gateway worker %d (pid %d) reads its feed too slowly: cut off", self.index, self.pid)
            self.writer.close()
            return
        self.writer.write(data)


class FeedHub:
    """The main process's end: serves the feed to workers and adds their counters into ``routes``."""

    def __init__(
        self,
        routes: RouteTable,
        secret: str,
        path: Path,
        ready: Callable[[], bool],
        *,
        workers: int = 1,
        poll_s: float = 0.05,
        heartbeat_s: float = 0.5,
        rebalance_s: float = 0.25,
    ) -> None:
        self.routes = routes
        self.secret = secret
        self.path = path
        self.ready = ready
        self.poll_s = poll_s
        self.heartbeat_s = heartbeat_s
        self.rebalance_s = rebalance_s
        self.merger = CounterMerger(routes)
        self.rates = DemandShares(workers)
        """Each worker's fractions of the tenants' rates."""
        self.generations = GenerationOwner(GenerationLimits())
        """The tenants' generation limits (streams, tokens per minute), for every worker."""
        self.workers: dict[int, _Worker] = {}
        """Connected workers by :attr:`_Worker.key` (index and pid)."""
        self.refused = 0
        """Connections refused (wrong secret, malformed): for tests and logs."""
        self.ejected: set[str] = set()
        """Routed replicas that a worker said it ejected and that no readmission has ended since."""
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._snapshot = b""
        self._changed = asyncio.Event()

    async def start(self) -> None:
        self.path.unlink(missing_ok=True)
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path), limit=MAX_LINE)
        os.chmod(self.path, 0o600)
        self._snapshot = _line({"t": "snapshot", **route_snapshot(self.routes)})
        self._spawn(self._publish())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self.workers.values()):
            w.writer.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.path.unlink(missing_ok=True)

    def broadcast(self, message: dict[str, Any]) -> None:
        data = _line(message)
        for w in list(self.workers.values()):
            w.send(data)

    def readmit(self, replica_id: str) -> None:
        """The controller found ``replica_id`` ready: end its ejection at every worker, if one ejected it (the
        controller says so after every probe that passes: a set lookup then, no message)."""
        if replica_id in self.ejected:
            self.ejected.discard(replica_id)
            self.broadcast({"t": "readmit", "replica": replica_id})

    def forget(self, key_id: str | None, tenant: str | None) -> None:
        self.broadcast({"t": "forget", "key": key_id, "tenant": tenant})

    def serving(self) -> dict[int, tuple[int, int]]:
        """Worker index → (http, grpc) ports, for the workers that connected and listen."""
        return {w.index: w.ports for w in self.workers.values() if w.ports is not None}

    def served(self) -> dict[int, int]:
        """Worker index → requests it carried (what it pushed) since the hub started, over its restarts."""
        out: dict[int, int] = {}
        for key, n in self.merger.served.items():
            index = key // 2**32
            out[index] = out.get(index, 0) + n
        return out

    def _send_shares(self, worker: _Worker) -> None:
        held = {
            "rates": self.rates.held[worker.index],
            "inflight_elsewhere": self.merger.elsewhere(worker.key),
        }
        if held != worker.shares:
            worker.shares = held
            worker.send(_line({"t": "shares", **held}))

    def _ejected(self, replica: object) -> None:
        """A worker ejected ``replica``'s endpoint: the next probe that finds it ready readmits it everywhere (one
        the main table no longer routes to is let be: nothing would readmit it)."""
        if not isinstance(replica, str):
            raise ShareError("ejected needs a replica id")
        endpoint = self.routes.endpoint(replica)
        if endpoint is not None:
            self.ejected.add(replica)
            for callback in self.routes.on_eject:  # as if this table had ejected it (the controller probes it soon)
                callback(endpoint)

    async def _publish(self) -> None:
        last_beat = last_rebalance = 0.0
        was_ready: bool | None = None
        while True:
            snapshot = _line({"t": "snapshot", **route_snapshot(self.routes)})
            if snapshot != self._snapshot:
                self._snapshot = snapshot
                self.ejected = {r for r in self.ejected if self.routes.endpoint(r) is not None}
                for w in list(self.workers.values()):
                    w.send(snapshot)
            ready = self.ready()
            now = time.monotonic()
            if now - last_rebalance >= self.rebalance_s:
                self.rates.rebalance()
                last_rebalance = now
            for w in list(self.workers.values()):
                self._send_shares(w)
            if ready != was_ready or now - last_beat >= self.heartbeat_s:
                self.broadcast({"t": "ready", "ready": ready})
                was_ready, last_beat = ready, now
            await asyncio.sleep(self.poll_s)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        worker: _Worker | None = None
        try:
            hello = _parse(await asyncio.wait_for(reader.readuntil(b"\n"), HELLO_TIMEOUT_S))
            index, pid = hello.get("worker"), hello.get("pid")
            if hello["t"] != "hello" or not internal_auth.matches(self.secret, hello.get("secret")):
                raise ShareError("the first message must be hello with the cloud's internal secret")
            if not (isinstance(index, int) and isinstance(pid, int) and 0 < pid < 2**32):
                raise ShareError("hello needs an integer worker index and pid")
            if not 0 <= index < self.rates.workers:
                raise ShareError(f"worker index {index} is not one of 0..{self.rates.workers - 1}")
            worker = _Worker(index, pid, writer)
            self.workers[worker.key] = worker
            worker.send(self._snapshot)
            self._send_shares(worker)
            worker.send(_line({"t": "ready", "ready": self.ready()}))
            while True:
                line = await reader.readuntil(b"\n")
                message = _parse(line)
                if message["t"] == "counters":
                    self.merger.add(worker.key, message)
                elif message["t"] == "demand":
                    self.rates.add(index, message.get("tenants"))
                elif message["t"] == "admit":
                    worker.send(_line(self.generations.admit(worker.key, message)))
                elif message["t"] == "settle":
                    self.generations.settle(worker.key, message)
                elif message["t"] == "serving":
                    ports = message.get("ports")
                    if not (isinstance(ports, list) and len(ports) == 2 and all(isinstance(p, int) for p in ports)):
                        raise ShareError("serving needs [http_port, grpc_port]")
                    worker.ports = (ports[0], ports[1])
                    log.info("gateway worker %d (pid %d) serves", index, pid)
                elif message["t"] == "ejected":
                    self._ejected(message.get("replica"))
                else:
                    raise ShareError(f"unknown message {message['t']!r}")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the worker went away (a partial last line is dropped: nothing of it was added)
        except (ShareError, TimeoutError, asyncio.LimitOverrunError, ValueError) as exc:
            if worker is None:
                self.refused += 1
            log.warning("gateway feed: connection refused: %s", exc)
            with contextlib.suppress(Exception):
                writer.write(_line({"t": "refused", "error": str(exc)}))
                await asyncio.wait_for(writer.drain(), 1.0)
        finally:
            if worker is not None:
                self.workers.pop(worker.key, None)
                self.merger.gone(worker.key)
                self.rates.gone(worker.index)
                self.generations.gone(worker.key)
            writer.close()


class FeedClient:
    """A worker's end: keeps ``routes`` a copy of the main table (and of what the other workers have in flight) and
    ``limiter``'s rate fractions those the main process set, and pushes what it counted."""

    def __init__(
        self,
        path: Path,
        secret: str,
        worker: int,
        routes: RouteTable,
        forget: Callable[[str | None, str | None], None],
        limiter: SharedRateLimiter,
        *,
        push_s: float = 0.25,
        stale_s: float = 3.0,
    ) -> None:
        self.path = path
        self.secret = secret
        self.worker = worker
        self.routes = routes
        self.forget = forget
        self.limiter = limiter
        self.push_s = push_s
        self.stale_s = stale_s
        self.tracker = CounterTracker(routes)
        self.generations = RemoteGenerationLimits(self._send)
        """The tenants' generation limits, as the main process holds them."""
        routes.on_eject.append(lambda e: self._send({"t": "ejected", "replica": e.replica_id}))
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._main_ready = False
        self._heard = 0.0

    def ready(self) -> bool:
        """The controller's loop runs, as the main process said less than ``stale_s`` ago."""
        return self._main_ready and time.monotonic() - self._heard < self.stale_s

    async def connect(self) -> None:
        """Connect, say hello, and apply the first snapshot and rate fractions (a worker serves only with the routes
        and the rate it was given)."""
        self._reader, self._writer = await asyncio.open_unix_connection(str(self.path), limit=MAX_LINE)
        self._send({"t": "hello", "secret": self.secret, "worker": self.worker, "pid": os.getpid()})
        for expected in ("snapshot", "shares"):
            message = _parse(await asyncio.wait_for(self._reader.readuntil(b"\n"), HELLO_TIMEOUT_S))
            if message["t"] != expected:
                raise ShareError(f"the main process answered {message.get('error') or message['t']!r}")
            self._apply(message)

    def _send(self, message: dict[str, Any]) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(_line(message))

    def serving(self, http_port: int, grpc_port: int) -> None:
        self._send({"t": "serving", "ports": [http_port, grpc_port]})

    def push(self) -> None:
        delta = self.tracker.take()
        if delta is not None:
            self._send({"t": "counters", **delta})
        demand = self.limiter.take_demand()
        if demand:
            self._send({"t": "demand", "tenants": demand})

    async def flush(self) -> None:
        """Push what was counted and wait until it left this process."""
        self.push()
        if self._writer is not None and not self._writer.is_closing():
            with contextlib.suppress(ConnectionError, TimeoutError):
                await asyncio.wait_for(self._writer.drain(), 2.0)

    async def run(self) -> None:
        """Apply the feed and push counters until the connection ends (returns then)."""
        assert self._reader is not None, "connect() first"
        pusher = asyncio.create_task(self._push_forever())
        try:
            while True:
                try:
                    line = await self._reader.readuntil(b"\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    log.warning("gateway worker %d: the main process closed the feed", self.worker)
                    return
                self._apply(_parse(line))
        finally:
            self.generations.close()
            pusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pusher

    async def _push_forever(self) -> None:
        while True:
            await asyncio.sleep(self.push_s)
            self.push()

    def _apply(self, message: dict[str, Any]) -> None:
        self._heard = time.monotonic()
        kind = message["t"]
        if kind == "snapshot":
            apply_snapshot(self.routes, message)
        elif kind == "shares":
            elsewhere = parse_levels(message.get("inflight_elsewhere"))
            self.limiter.set_fractions(message.get("rates"))  # checked before anything changes, as elsewhere was
            self.routes.inflight_elsewhere = elsewhere
        elif kind in ("admitted", "over"):
            self.generations.answer(message)
        elif kind == "ready":
            self._main_ready = message.get("ready") is True
        elif kind == "readmit":
            replica = message.get("replica")
            if isinstance(replica, str):
                self.routes.readmit(replica)
        elif kind == "forget":
            key, tenant = message.get("key"), message.get("tenant")
            self.forget(key if isinstance(key, str) else None, tenant if isinstance(tenant, str) else None)
        elif kind == "refused":
            raise ShareError(f"the main process refused this worker: {message.get('error')}")

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
