"""One HTTP/2 connection of the gRPC client (:mod:`octacloud.protocols.grpc.h2_client`): the calls on it, their
windows, and the frames of the answers, read as they arrive into an :class:`Answer` per call.

A call's request goes as one HEADERS (and CONTINUATION) and DATA frames in one write; its answer ends in
trailers or in a trailers-only HEADERS frame. :class:`Unreachable` means the replica never saw the call.
"""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast
from urllib.parse import unquote

import grpc
import hpack

from octacloud.idlespin import poke
from octacloud.protocols.grpc.h2_frames import (
    ACK,
    CANCEL,
    CONTINUATION,
    DATA,
    DEFAULT_FRAME,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    MAX_WINDOW,
    NO_ERROR,
    OK_TRAILERS,
    PADDED,
    PING,
    PREFACE,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    RESPONSE_HEADERS,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    TurnOutput,
    frame,
    read_frames,
)
from octacloud.protocols.headers import REPLICA_MAX_HEADER_BYTES

_U32 = struct.Struct(">I")
_CODES = {c.value[0]: c for c in grpc.StatusCode}
_HTTP_CODES = {
    400: grpc.StatusCode.INTERNAL,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.UNIMPLEMENTED,
    429: grpc.StatusCode.UNAVAILABLE,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.UNAVAILABLE,
}  # gRPC's HTTP-to-status mapping, for an answer that is not gRPC
_OMITTED = frozenset({"grpc-status", "grpc-message", "content-type", "grpc-encoding", "grpc-accept-encoding"})
_OK = [("grpc-status", "0")]


class Unreachable(Exception):
    """The replica did not take the call (no connection, or the connection ended before the call was taken)."""


@dataclass(slots=True)
class Answer:
    code: grpc.StatusCode
    details: str
    trailing: tuple[tuple[str, str | bytes], ...]
    message: bytes
    """The response message (empty unless ``code`` is OK)."""


@dataclass(slots=True)
class _Call:
    id: int
    future: asyncio.Future[Answer]
    send_window: int
    pending: bytearray  # DATA payload not yet sent (waiting for window)
    status: int = 0
    data: bytearray = field(default_factory=bytearray)
    block: bytearray | None = None  # a header block awaiting CONTINUATION
    block_ends: bool = False


class ClientConnection(asyncio.Protocol):
    """One HTTP/2 connection of a :class:`~octacloud.protocols.grpc.h2_client.Channel`: its calls in flight, its
    windows, the frames it reads; ``dropped`` is told when the connection is lost."""

    def __init__(self, label: str, dropped: Callable[[ClientConnection], None]) -> None:
        self._label = label
        self._dropped = dropped
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._decoder = hpack.Decoder(max_header_list_size=REPLICA_MAX_HEADER_BYTES)  # a replica's answers
        self.calls: dict[int, _Call] = {}
        self._next = 1
        self._send_window = 65535
        self._initial_window = 65535
        self._max_frame = DEFAULT_FRAME
        self.max_streams = 100  # until the replica's SETTINGS say (RFC 9113 recommends at least 100)
        self._received = 0
        self._continuation: _Call | None = None
        self._orphan_block: bytearray | None = None  # a header block of a stream we no longer track
        self.going_away = False
        self.closed = False
        self._out = TurnOutput(lambda: self.transport)

    # ---- asyncio.Protocol --------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        settings = struct.pack(">HIHIHI", 0x2, 0, 0x4, MAX_WINDOW, 0x3, 0)  # no push, big stream windows
        self.transport.write(
            PREFACE + frame(SETTINGS, 0, 0, settings) + frame(WINDOW_UPDATE, 0, 0, _U32.pack(MAX_WINDOW - 65535))
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        self._dropped(self)
        calls, self.calls = self.calls, {}
        for c in calls.values():
            self._settle_error(c, Unreachable(f"the connection to {self._label} closed"))

    def data_received(self, data: bytes) -> None:
        poke()
        buf = self._buffer
        buf += data
        try:  # we never allow frames over the default size (no SETTINGS_MAX_FRAME_SIZE sent)
            consumed = read_frames(buf, DEFAULT_FRAME, self._frame)
        except (ValueError, struct.error, hpack.HPACKError) as e:
            self._abandon(f"{self._label} broke HTTP/2: {e}")
            return
        del buf[:consumed]
        if self._received >= 2**20:
            self._write(frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._received)))
            self._received = 0

    # ---- frames ------------------------------------------------------------------------------------------
    def _frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if kind == DATA:
            self._received += len(payload)
            c = self.calls.get(sid)
            if c is not None:
                if flags & PADDED:
                    payload = payload[1 : len(payload) - payload[0]]
                c.data += payload
                if flags & END_STREAM:
                    self._complete(c, [])
        elif kind == HEADERS:
            start, end = 0, len(payload)
            if flags & PADDED:
                start, end = 1, end - payload[0]
            if flags & PRIORITY_FLAG:
                start += 5
            block = payload[start:end]
            c = self.calls.get(sid)
            if flags & END_HEADERS:
                self._headers(c, block, bool(flags & END_STREAM))
            elif c is not None:
                c.block, c.block_ends, self._continuation = bytearray(block), bool(flags & END_STREAM), c
            else:
                self._orphan_block = bytearray(block)
        elif kind == CONTINUATION:
            self._continuation_frame(flags, sid, payload)
        elif kind == SETTINGS:
            if not flags & ACK:
                self._settings(payload)
        elif kind == PING:
            if not flags & ACK:
                self._write(frame(PING, ACK, 0, payload))
        elif kind == WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif kind == RST_STREAM:
            self._stream_reset(sid, payload)
        elif kind == GOAWAY:
            self._goaway(payload)

    def _continuation_frame(self, flags: int, sid: int, payload: bytes) -> None:
        """More of a header block: the call's, or one of a call no longer here (decoded for the HPACK table)."""
        c = self._continuation
        if c is not None and c.id == sid and c.block is not None:
            c.block += payload
            if flags & END_HEADERS:
                block, c.block, self._continuation = bytes(c.block), None, None
                self._headers(c, block, c.block_ends)
        elif self._orphan_block is not None:
            self._orphan_block += payload
            if flags & END_HEADERS:
                self._decoder.decode(bytes(self._orphan_block))  # keep the HPACK table in step
                self._orphan_block = None
        else:
            raise ValueError("unexpected CONTINUATION")

    def _window_update(self, sid: int, payload: bytes) -> None:
        """More send window: the connection's (every call with data pending sends on) or one call's."""
        increment = _U32.unpack(payload)[0] & MAX_WINDOW
        if sid == 0:
            self._send_window += increment
            for pending in list(self.calls.values()):
                if pending.pending:
                    self._send(pending)
        elif (c := self.calls.get(sid)) is not None:
            c.send_window += increment
            self._send(c)

    def _stream_reset(self, sid: int, payload: bytes) -> None:
        """The replica reset a call: a refused stream is unreachable (retried elsewhere), any other an INTERNAL."""
        c = self.calls.pop(sid, None)
        if c is not None:
            code = _U32.unpack(payload)[0]
            if code == REFUSED_STREAM:
                self._settle_error(c, Unreachable(f"{self._label} refused the stream"))
            else:
                details = f"the replica reset the call (HTTP/2 error {code})"
                self._settle(c, Answer(grpc.StatusCode.INTERNAL, details, (), b""))
            self._maybe_close()

    def _goaway(self, payload: bytes) -> None:
        """The replica is going away: the calls after the last one it will answer are unreachable."""
        last = _U32.unpack_from(payload, 0)[0] & MAX_WINDOW
        self.going_away = True
        for sid_ in [s for s in self.calls if s > last]:
            self._settle_error(self.calls.pop(sid_), Unreachable(f"{self._label} is going away"))
        self._maybe_close()

    def _settings(self, payload: bytes) -> None:
        for i in range(0, len(payload) - len(payload) % 6, 6):
            key, value = struct.unpack_from(">HI", payload, i)
            if key == 0x3:
                self.max_streams = value
            elif key == 0x4:
                delta, self._initial_window = value - self._initial_window, value
                for c in self.calls.values():
                    c.send_window += delta
            elif key == 0x5:
                self._max_frame = value
        self._write(frame(SETTINGS, ACK, 0))
        for c in list(self.calls.values()):
            if c.pending:
                self._send(c)

    def _headers(self, c: _Call | None, block: bytes, ends: bool) -> None:
        if c is not None and not ends and block == RESPONSE_HEADERS and not c.status:
            c.status = 200  # octacloud's server: these literals leave the HPACK table as it is, no need to decode
            return
        if c is not None and ends and block == OK_TRAILERS and c.status == 200:
            self._complete(c, _OK)
            return
        headers = cast(list[tuple[str, str]], self._decoder.decode(block))  # always: keeps the HPACK table in step
        if c is None:
            return
        if not c.status:  # the response headers (or a trailers-only answer)
            for k, v in headers:
                if k == ":status":
                    c.status = int(v)
                    break
            else:
                raise ValueError("response headers without :status")
            if not ends:
                return
        if ends:
            self._complete(c, headers)

    def _complete(self, c: _Call, trailers: list[tuple[str, str]]) -> None:
        """The call's stream ended (trailers, or DATA with END_STREAM)."""
        self.calls.pop(c.id, None)
        code: grpc.StatusCode | None = None
        details = ""
        trailing: list[tuple[str, str | bytes]] = []
        for k, v in trailers:
            if k == "grpc-status":
                code = _CODES.get(int(v) if v.isdigit() else -1, grpc.StatusCode.UNKNOWN)
            elif k == "grpc-message":
                details = unquote(v)
            elif k[0] != ":" and k not in _OMITTED:
                trailing.append((k, base64.b64decode(v + "==") if k.endswith("-bin") else v))
        if c.status != 200:
            code = _HTTP_CODES.get(c.status, grpc.StatusCode.UNKNOWN)
            details = details or f"the replica answered HTTP status {c.status}"
        elif code is None:
            code, details = grpc.StatusCode.INTERNAL, "the replica's answer has no grpc-status"
        message = b""
        if code is grpc.StatusCode.OK:
            data = c.data
            if len(data) < 5 or data[0] or _U32.unpack_from(data, 1)[0] != len(data) - 5:
                code, details = grpc.StatusCode.INTERNAL, "the replica's answer is not exactly one plain message"
            else:
                with memoryview(data) as view:
                    message = bytes(view[5:])  # one copy (a slice of the bytearray first would be two)
        c.pending.clear()  # the replica answered: what we had not sent yet is no longer wanted
        self._settle(c, Answer(code, details, tuple(trailing), message))
        self._maybe_close()

    # ---- calls -------------------------------------------------------------------------------------------
    @property
    def usable(self) -> bool:
        return not self.closed and not self.going_away and len(self.calls) < self.max_streams

    def start(self, head: bytes, message: bytes, future: asyncio.Future[Answer]) -> _Call:
        if self.closed or self.transport is None or self.transport.is_closing():
            raise Unreachable(f"the connection to {self._label} closed before the call was sent")
        sid = self._next
        self._next += 2
        if self._next > MAX_WINDOW:
            self.going_away = True  # stream ids exhausted: new calls go on a new connection
        pending = bytearray(b"\x00" + _U32.pack(len(message)))
        pending += message  # one copy of the message (concatenating first would make two)
        c = _Call(sid, future, self._initial_window, pending)
        self.calls[sid] = c
        n, limit = len(head), self._max_frame
        if n <= limit:
            out = frame(HEADERS, END_HEADERS, sid, head)
        else:
            out = frame(HEADERS, 0, sid, head[:limit])
            for i in range(limit, n, limit):
                out += frame(CONTINUATION, END_HEADERS if i + limit >= n else 0, sid, head[i : i + limit])
        # at once, not with the rest of this loop turn's calls (the module's docstring)
        self._out.write_now(self._data_frames(c, bytearray(out)))
        return c

    def _send(self, c: _Call) -> None:
        """Queue what the windows now allow of ``c``'s unsent message, for this loop turn's one write."""
        out = self._data_frames(c, bytearray())
        if out:
            self._write(out)

    def _data_frames(self, c: _Call, out: bytearray) -> bytearray:
        """Append to ``out`` DATA frames for as much of ``c``'s unsent message as the windows allow (a bytearray:
        linear in the message's size), and take it from what is pending and from the windows."""
        pending = c.pending
        while pending:
            n = min(len(pending), self._max_frame, self._send_window, c.send_window)
            if n <= 0:
                break
            last = n == len(pending)
            out += frame(DATA, END_STREAM if last else 0, c.id, bytes(pending[:n]))
            del pending[:n]
            self._send_window -= n
            c.send_window -= n
        return out

    def cancel(self, c: _Call) -> None:
        if self.calls.pop(c.id, None) is not None:
            self._write(frame(RST_STREAM, 0, c.id, _U32.pack(CANCEL)))
            self._maybe_close()

    def _settle(self, c: _Call, answer: Answer) -> None:
        if not c.future.done():
            c.future.set_result(answer)

    def _settle_error(self, c: _Call, error: Exception) -> None:
        if not c.future.done():
            c.future.set_exception(error)

    # ---- output ------------------------------------------------------------------------------------------
    def _write(self, data: bytes | bytearray) -> None:
        """Queue ``data``; what this loop turn queues goes out in one write."""
        self._out.write(data)

    def _maybe_close(self) -> None:
        if self.going_away and not self.calls:
            self.close()

    def _abandon(self, why: str) -> None:
        self._write(frame(GOAWAY, 0, 0, _U32.pack(0) + _U32.pack(PROTOCOL_ERROR) + why.encode()[:200]))
        self.close()
        calls, self.calls = self.calls, {}
        for c in calls.values():
            self._settle(c, Answer(grpc.StatusCode.INTERNAL, why, (), b""))

    def close(self) -> None:
        self.going_away = True
        if self.transport is not None and not self.transport.is_closing():
            self._out.flush()
            self.transport.close()

    def goodbye(self) -> None:
        self._write(frame(GOAWAY, 0, 0, _U32.pack(0) + _U32.pack(NO_ERROR)))
        self.close()

    def drain(self) -> None:
        """No new call on this connection; it closes once the calls in flight are answered."""
        if not self.going_away and not self.closed:
            self._write(frame(GOAWAY, 0, 0, _U32.pack(0) + _U32.pack(NO_ERROR)))
        self.going_away = True
        self._maybe_close()


__all__ = ["Answer", "ClientConnection", "Unreachable"]
