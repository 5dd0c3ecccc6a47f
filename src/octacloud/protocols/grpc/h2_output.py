"""The answering half of a connection of octacloud's HTTP/2 server: each call's task, and what it sends back
(response headers, DATA within the client's windows, trailers), queued so that one loop turn is one write; see
``h2_connection`` for the reading half and ``h2_limits`` for the bounds."""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from octacloud.protocols.grpc.h2_calls import Abort, CallContext, Method
from octacloud.protocols.grpc.h2_frames import (
    ACK,
    DATA,
    DEFAULT_FRAME,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    MAX_WINDOW,
    NO_ERROR,
    OK_TRAILERS,
    PROTOCOL_ERROR,
    RESPONSE_HEADERS,
    RST_STREAM,
    SETTINGS,
    U32,
    TurnOutput,
    frame,
    metadata_block,
    trailers,
)
from octacloud.protocols.grpc.h2_limits import FrameBudget, InputBudget
from octacloud.protocols.grpc.servicer import code_of
from octacloud.serving import ModelExecutionError

if TYPE_CHECKING:
    from octacloud.protocols.grpc.h2 import Http2Server

log = logging.getLogger("octacloud.protocols.grpc.h2")
LINGER_S = 1.0
"""How long a connection ended by an error keeps reading (and dropping) what its client still sends (Go's
HTTP/2 server waits as long after its GOAWAY)."""


@dataclass(slots=True)
class Stream:
    id: int
    send_window: int
    block: bytearray | None = None  # a header block awaiting CONTINUATION
    headers_done: bool = False
    method: Method | None = None
    path: str = ""
    metadata: tuple[tuple[str, str | bytes], ...] = ()
    state: Any = None
    data: bytearray = field(default_factory=bytearray)
    remote_closed: bool = False
    task: asyncio.Task[None] | None = None
    inbox: asyncio.Queue[bytes | None] | None = None  # streaming: messages as they arrive
    sent_headers: bool = False
    pending: bytearray = field(default_factory=bytearray)  # DATA payload waiting for window
    pending_trailers: bytes | None = None
    error: str = ""
    owner: Hashable = None
    """Whose budget the stream's input is held on (the server's ``owner`` hook on the call's state; the connection
    for a caller the hook cannot name)."""
    held: int = 0
    """Bytes of its input held for it (metadata, its partial or unread messages), on its connection's and its
    owner's budgets."""
    waiting: bool = False
    """Counted among its owner's calls waiting for their message."""
    since: float = 0.0
    """Loop time of its HEADERS."""


class ConnectionFault(Exception):
    """The client broke HTTP/2 or a bound of ``h2_limits``: the connection ends with GOAWAY ``code``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class ConnectionOutput:
    """What a connection sends, and the calls that produce it. The reading half (``Http2Connection``) sets the
    state it shares."""

    def __init__(self, server: Http2Server) -> None:
        self._server = server
        self._transport: asyncio.Transport | None = None
        self._streams: dict[int, Stream] = {}
        self._send_window = 65535
        self._initial_window = 65535
        self._max_frame = DEFAULT_FRAME
        self._last_stream = 0
        self._going_away = False
        self._peer = "unknown"
        self._out = TurnOutput(lambda: self._transport)  # frames to send at the end of this loop turn
        self._idle_since = 0.0  # loop time since which no stream is open
        self._budget = FrameBudget(server.limits, server.now)
        self._inputs: InputBudget = server.inputs
        self._held = 0
        """Bytes held for this connection's calls (see ``Stream.held``)."""
        self._closed_at: float | None = None
        """Loop time at which we closed (or shut our side of) the connection."""
        self._lingering = False

    # ---- calls -------------------------------------------------------------------------------------------
    async def _unary(self, s: Stream, message: bytes) -> None:
        method = s.method
        assert method is not None
        context = CallContext(s.metadata, self._peer, s.state)
        server = self._server
        server.calls += 1
        try:
            if method.parse is None:
                out = await method.call(message, context)
            else:
                out = (await method.call(method.parse(message), context)).SerializeToString()
        except Exception as e:  # (a cancelled call's CancelledError is no Exception: it goes on)
            self._fail_with(s, e)
            return
        finally:
            server.calls -= 1
        extra = metadata_block(context.trailing)
        if context.code is not None and context.code is not grpc.StatusCode.OK:
            self._fail(s, context.code, context.details, extra=extra)
            return
        self._respond(s, b"\x00" + U32.pack(len(out)) + out, extra + OK_TRAILERS)

    async def _streaming(self, s: Stream) -> None:
        method = s.method
        assert method is not None and s.inbox is not None
        inbox = s.inbox
        context = CallContext(s.metadata, self._peer, s.state)
        parse = method.parse or bytes

        async def requests() -> AsyncIterator[Any]:
            while (message := await inbox.get()) is not None:
                self._release(s, 5 + len(message))  # taken by the call: no longer the connection's to hold
                yield parse(message)

        try:
            async for response in method.call(requests(), context):
                out = response if method.parse is None else response.SerializeToString()
                self._respond(s, b"\x00" + U32.pack(len(out)) + out, None)
        except Exception as e:  # (as in _unary)
            self._fail_with(s, e)
            return
        self._respond(s, b"", metadata_block(context.trailing) + OK_TRAILERS)

    def _fail_with(self, s: Stream, error: Exception) -> None:
        """End the call that raised ``error``: an :class:`Abort` with its code, details and trailing metadata;
        anything else with its status from the one error table (logged when it is an internal error)."""
        if isinstance(error, Abort):
            self._fail(s, error.code, error.details, extra=metadata_block(error.trailing))
            return
        code = code_of(error)
        if code is grpc.StatusCode.INTERNAL and not isinstance(error, ModelExecutionError):
            log.exception("internal error", exc_info=error)
        self._fail(s, code, str(error))

    # ---- what calls hold ---------------------------------------------------------------------------------
    def _hold(self, s: Stream, n: int) -> str | None:
        """Hold ``n`` more bytes of input for ``s``, or say why not (a bound of ``h2_limits``)."""
        why = self._inputs.take(s.owner, n, self._held)
        if why is None:
            s.held += n
            self._held += n
        return why

    def _release(self, s: Stream, n: int) -> None:
        n = min(n, s.held)
        s.held -= n
        self._held -= n
        self._inputs.give_back(s.owner, n)

    def _unhold(self, s: Stream) -> None:
        """``s`` no longer waits for input: what it held is given back, and its place among its owner's calls
        waiting for their message."""
        if s.held:
            self._release(s, s.held)
        if s.waiting:
            s.waiting = False
            self._inputs.close(s.owner)

    # ---- the client's settings and windows -------------------------------------------------------------------
    def _settings(self, payload: bytes) -> None:
        if len(payload) % 6:
            raise ConnectionFault(FRAME_SIZE_ERROR, "SETTINGS length not a multiple of 6")
        entries = self._server.limits.max_settings_entries
        if len(payload) > 6 * entries:
            raise ConnectionFault(ENHANCE_YOUR_CALM, f"SETTINGS of more than {entries} entries")
        for i in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, i)
            if key == 0x4:
                if value > MAX_WINDOW:
                    raise ConnectionFault(FLOW_CONTROL_ERROR, "initial window over 2^31-1")
                delta, self._initial_window = value - self._initial_window, value
                for s in self._streams.values():
                    s.send_window += delta
            elif key == 0x5:
                if not DEFAULT_FRAME <= value < 2**24:
                    raise ConnectionFault(PROTOCOL_ERROR, f"max frame size {value}")
                self._max_frame = value
            # HEADER_TABLE_SIZE bounds our encoder's table, which we never use (literals without indexing)
        self._write(frame(SETTINGS, ACK, 0))
        self._flush_all()

    def _window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ConnectionFault(FRAME_SIZE_ERROR, "WINDOW_UPDATE of the wrong size")
        increment = U32.unpack(payload)[0] & MAX_WINDOW
        if increment == 0:  # RFC 9113 6.9: an error of the connection (stream 0) or of the stream
            if sid == 0:
                raise ConnectionFault(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self._reset_stream(sid, PROTOCOL_ERROR)
            return
        if sid == 0:
            self._send_window += increment
            if self._send_window > MAX_WINDOW:
                raise ConnectionFault(FLOW_CONTROL_ERROR, "connection window over 2^31-1")
            self._flush_all()
        elif (s := self._streams.get(sid)) is not None:
            s.send_window += increment
            if s.send_window > MAX_WINDOW:  # RFC 9113 6.9.1: an error of that stream alone
                self._reset_stream(sid, FLOW_CONTROL_ERROR)
                return
            self._flush(s)

    def _reset_stream(self, sid: int, code: int) -> None:
        """End stream ``sid`` with RST_STREAM ``code``: what it held given back, its call cancelled."""
        if (s := self._streams.pop(sid, None)) is not None:
            self._unhold(s)
            if s.task is not None:
                s.task.cancel()
            self._write(frame(RST_STREAM, 0, sid, U32.pack(code)))

    # ---- output ------------------------------------------------------------------------------------------
    def _respond(self, s: Stream, data: bytes, trailers: bytes | None) -> None:
        """Send response headers (once), ``data`` as DATA frames and, if given, the trailers ending the stream,
        in one write when the windows allow; what they do not allow waits for WINDOW_UPDATE."""
        if self._transport is None or self._streams.get(s.id) is not s:
            return
        out = b""
        if not s.sent_headers:
            s.sent_headers = True
            out = frame(HEADERS, END_HEADERS, s.id, RESPONSE_HEADERS)
        s.pending += data
        if trailers is not None:
            s.pending_trailers = trailers
        self._flush(s, out)

    def _flush(self, s: Stream, out: bytes = b"") -> None:
        if out:
            self._write(out)
        pending = s.pending
        while pending:  # each frame joins this loop turn's one write (a bytearray: linear in the message's size)
            n = min(len(pending), self._max_frame, self._send_window, s.send_window)
            if n <= 0:
                break
            self._write(frame(DATA, 0, s.id, bytes(pending[:n])))
            self._budget.data_sent += 1
            del pending[:n]
            self._send_window -= n
            s.send_window -= n
        done = not pending and s.pending_trailers is not None
        if done:
            self._write(frame(HEADERS, END_HEADERS | END_STREAM, s.id, s.pending_trailers))  # type: ignore[arg-type]
            s.pending_trailers = None
        if done:  # after the write: a connection going away closes once its last stream is finished
            self._finished(s)

    def _flush_all(self) -> None:
        for s in list(self._streams.values()):
            if s.pending or s.pending_trailers is not None:
                self._flush(s)

    def _fail(self, s: Stream, code: grpc.StatusCode, message: str, reset: bool = False, extra: bytes = b"") -> None:
        """End the call with ``code``: trailers-only if nothing was sent yet (and RST_STREAM if asked, when the
        client is still sending)."""
        s.error = s.error or message or code.name
        if self._transport is None or self._streams.get(s.id) is not s:
            return
        s.pending.clear()
        if s.sent_headers:
            out = frame(HEADERS, END_HEADERS | END_STREAM, s.id, trailers(code, message, extra))
        else:
            block = RESPONSE_HEADERS + trailers(code, message, extra)
            out = frame(HEADERS, END_HEADERS | END_STREAM, s.id, block)
        if reset and not s.remote_closed:
            out += frame(RST_STREAM, 0, s.id, U32.pack(NO_ERROR))
        self._write(out)
        if s.task is not None and s.task is not asyncio.current_task():
            s.task.cancel()
        self._finished(s)

    def _finished(self, s: Stream) -> None:
        self._unhold(s)
        s.data = bytearray()
        streams = self._streams
        streams.pop(s.id, None)
        if not streams:
            self._idle_since = self._server.now()
            if self._going_away:
                self._close()

    def _write(self, data: bytes) -> None:
        """Queue ``data``; everything queued in one loop turn (the responses of one batch) is one write."""
        self._out.write(data)

    def _goaway(self, code: int, reason: str) -> None:
        """Tell the client why the connection ends, and end it. After an error the connection lingers: our side
        is shut (the client reads the GOAWAY, then the end) and what the client still sends is read and
        dropped for up to :data:`LINGER_S`, so that no reset from our side overtakes the GOAWAY."""
        log.info("closing an HTTP/2 connection from %s: %s", self._peer, reason)
        self._write(frame(GOAWAY, 0, 0, U32.pack(self._last_stream) + U32.pack(code) + reason.encode()[:200]))
        transport = self._transport
        if code == NO_ERROR or transport is None or not transport.can_write_eof():
            self._close()
            return
        self._out.flush()
        transport.write_eof()
        self._lingering = True
        self._closed_at = self._server.now()

    def _close(self) -> None:
        if self._transport is not None:
            self._out.flush()
            self._transport.close()
            if self._closed_at is None:
                self._closed_at = self._server.now()

    def shut_down(self) -> None:
        """Refuse new calls (GOAWAY), finish those in flight, then close."""
        self._going_away = True
        self._write(frame(GOAWAY, 0, 0, U32.pack(self._last_stream) + U32.pack(NO_ERROR)))
        if not self._streams:
            self._close()

    @property
    def busy(self) -> bool:
        return bool(self._streams)


__all__ = ["LINGER_S", "ConnectionFault", "ConnectionOutput", "Stream"]
