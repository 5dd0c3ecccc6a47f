"""gRPC over HTTP/2 on the event loop itself: a lean server for Triton's ``GRPCInferenceService``.

Why not ``grpc.aio``: it hands every call event from grpc's poller thread to the event loop through a socket
(about five loop wake-ups and eleven system calls per unary call, measured); under load the loop spends its
time being woken instead of batching, and the process burns two to three times Triton's CPU per inference.
Here one read brings a request's frames, the servicer coroutine runs on the loop, and one write sends the
response's HEADERS, DATA and trailers (the responses of one batch on one connection share that write).
HPACK comes from the maintained ``hpack`` package; the rest of HTTP/2 that a gRPC server needs (RFC 9113:
settings, ping, flow control both ways, CONTINUATION, padding, RST_STREAM, GOAWAY) is here.

The methods are :class:`~octacloud.protocols.grpc.servicer.InferenceServicer`'s, called with a context whose
``abort`` ends the call with that status; so both servers answer alike.

:class:`Http2Server` is the same server for any set of methods, among them *raw* ones (``Method.parse`` is
None) that get the request message's bytes and answer bytes, never decoding a message: the cloud's gateway
proxies calls that way. Its ``admit`` hook sees each call's path and metadata before one byte of the message
is read (and may refuse it), its ``gate`` sees a unary call's whole message in the frame handling, before any
task (and may refuse it with one trailers-only HEADERS frame); a message whose length prefix is over the limit
is refused before its body arrives; calls in progress, streams per connection and connections are bounded; a
connection that has not sent its preface within ``header_timeout_s``, or has had no call for
``idle_timeout_s``, is closed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import socket
import ssl
import ssl as _ssl  # ``start``'s parameter is named ssl, as asyncio's
import struct
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias, cast
from urllib.parse import quote

import grpc
import hpack
from tritonclient.grpc import service_pb2 as pb

from octacloud.idlespin import poke
from octacloud.protocols.grpc.servicer import InferenceServicer, _lenient, code_of
from octacloud.protocols.headers import HEADER_LIST_BOMB_FACTOR, REPLICA_MAX_HEADER_BYTES, list_size
from octacloud.protocols.internal import HANDSHAKE_TIMEOUT_S, OPEN_GRPC_METHODS, REFUSED, matches, misdirected
from octacloud.protocols.internal import HEADER as SECRET_HEADER
from octacloud.serving import DataPlane, ModelExecutionError

log = logging.getLogger(__name__)
# hpack logs every header it decodes at DEBUG, keys and secrets among them: never let those records out
logging.getLogger("hpack").setLevel(logging.INFO)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL = 0, 1, 3, 6, 7, 8
COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 9, 11
MAX_WINDOW = 2**31 - 1
DEFAULT_FRAME = 2**14
_HEADER = struct.Struct(">BHBBI")  # 9-byte frame header: length (24 bits as 8 + 16), type, flags, stream
_U32 = struct.Struct(">I")
# :status 200 (static index 8) and content-type: application/grpc (literal, static name 31, not indexed)
_RESPONSE_HEADERS = b"\x88\x0f\x10\x10application/grpc"
_OK_TRAILERS = b"\x00\x0bgrpc-status\x010"
_SKIP = frozenset({"content-type", "te", "user-agent", "grpc-accept-encoding", "grpc-timeout", "grpc-encoding"})
_PSEUDO = frozenset({":method", ":scheme", ":path", ":authority"})
_CONNECTION_SPECIFIC = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade"})
_NOT_IN_NAMES = frozenset(range(0x21)) | frozenset(range(0x41, 0x5B)) | frozenset(range(0x7F, 0x100))
MAX_STATUS_MESSAGE = 2048
"""Characters of a status message sent (``grpc-message``); a longer one is cut, so that no answer's trailers grow
with what a request put in it."""


def malformed(headers: list[tuple[str, str]]) -> str | None:
    """Why a request's header list is malformed (RFC 9113 8.2 and 8.3), or None: a field name not in lower case
    or with a character names cannot hold, a pseudo-header unknown, repeated or after a regular field, a
    connection-specific field, or ``te`` other than ``trailers``."""
    regular = False
    seen: set[str] = set()
    for name, value in headers:
        if not name or any(ord(c) in _NOT_IN_NAMES for c in name.lstrip(":")):
            shown = name[:64].encode("unicode_escape").decode()
            if name.lower() != name:
                return f"header field name {shown!r} is not lower case (HTTP/2 names are lower case: RFC 9113 8.2.1)"
            return f"header field name {shown!r} holds a character names cannot hold (RFC 9113 8.2.1)"
        if name[0] == ":":
            if regular or name not in _PSEUDO or name in seen:
                return f"pseudo-header {name[:64]!r} is unknown, repeated or after a regular field (RFC 9113 8.3)"
            seen.add(name)
        else:
            regular = True
            if name in _CONNECTION_SPECIFIC or (name == "te" and value != "trailers"):
                return f"header field {name!r} is connection-specific: HTTP/2 forbids it (RFC 9113 8.2.2)"
    return None


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _HEADER.pack(n >> 16, n & 0xFFFF, kind, flags, stream) + payload


class TurnOutput:
    """What one loop turn queues for a connection, sent in one ``write`` at the turn's end. The buffer is handed
    to the transport whole and never changed after (no copy of it); nothing is queued once ``transport()`` is
    None (the connection is gone)."""

    __slots__ = ("_buffer", "_transport")

    def __init__(self, transport: Callable[[], asyncio.Transport | None]) -> None:
        self._buffer = bytearray()
        self._transport = transport

    def write(self, data: bytes | bytearray) -> None:
        if self._transport() is None:
            return
        if not self._buffer:
            asyncio.get_running_loop().call_soon(self.flush)
        self._buffer += data

    def write_now(self, data: bytes | bytearray) -> None:
        """Send ``data`` at once, after anything this turn has already queued (so frames keep their order),
        without scheduling an end-of-turn flush for it."""
        transport = self._transport()
        if transport is None:
            return
        if self._buffer:
            self._buffer += data
            self.flush()
        else:
            transport.write(data)

    def flush(self) -> None:
        out, self._buffer = self._buffer, bytearray()
        transport = self._transport()
        if out and transport is not None:
            transport.write(out)


class FrameTooLarge(ValueError):
    """A frame longer than the receiver allows (a connection error, FRAME_SIZE_ERROR)."""


def read_frames(buf: bytearray, max_length: int, on_frame: Callable[[int, int, int, bytes], None]) -> int:
    """Hand each whole frame at the start of ``buf`` to ``on_frame(kind, flags, stream, payload)``, in order;
    returns how many bytes they took (the caller drops them; a partial frame stays). Raises
    :class:`FrameTooLarge` for a frame over ``max_length``, and whatever ``on_frame`` raises."""
    pos, end = 0, len(buf)
    view = memoryview(buf)
    try:
        while end - pos >= 9:
            length = (buf[pos] << 16) | (buf[pos + 1] << 8) | buf[pos + 2]
            if length > max_length:
                raise FrameTooLarge(f"a frame of {length} bytes")
            if end - pos < 9 + length:
                break
            kind, flags = buf[pos + 3], buf[pos + 4]
            stream = _U32.unpack_from(buf, pos + 5)[0] & MAX_WINDOW
            payload = bytes(view[pos + 9 : pos + 9 + length])
            pos += 9 + length
            on_frame(kind, flags, stream, payload)
    finally:
        view.release()  # before the caller resizes the buffer
    return pos


def _literal(name: bytes, value: bytes) -> bytes:
    """A header field as a literal without indexing, new name, no Huffman (RFC 7541 6.2.2)."""
    return b"\x00" + _int7(len(name)) + name + _int7(len(value)) + value


def _int7(n: int) -> bytes:
    if n < 127:
        return bytes((n,))
    out, n = bytearray((127,)), n - 127
    while n >= 128:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def metadata_block(metadata: Any) -> bytes:
    """Custom metadata as header fields (``-bin`` values base64, as gRPC sends them)."""
    out = b""
    for key, value in metadata or ():
        raw = value if isinstance(value, bytes) else str(value).encode()
        if key.endswith("-bin"):
            raw = base64.b64encode(raw).rstrip(b"=")
        out += _literal(key.lower().encode(), raw)
    return out


def _trailers(code: grpc.StatusCode, message: str, extra: bytes = b"") -> bytes:
    block = extra + _literal(b"grpc-status", str(code.value[0]).encode())
    if len(message) > MAX_STATUS_MESSAGE:
        message = message[: MAX_STATUS_MESSAGE - 3] + "..."
    if message:
        block += _literal(b"grpc-message", quote(message, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~").encode())
    return block


Call: TypeAlias = tuple[str, tuple[tuple[str, str | bytes], ...], str, tuple[grpc.StatusCode, str] | None]
"""What a request's header block says: its path, metadata, ``grpc-encoding``, and why it is refused (or None)."""


def read_call(headers: list[tuple[str, str]], max_header_bytes: int) -> Call:
    """The call a decoded header block asks for. Refused: a malformed list (INTERNAL, as gRPC answers a malformed
    request) and a list over ``max_header_bytes`` as HTTP/2 counts it (RESOURCE_EXHAUSTED)."""
    path, encoding = "", "identity"
    metadata: list[tuple[str, str | bytes]] = []
    for k, v in headers:
        if k[0] == ":":
            if k == ":path":
                path = v
        elif k == "grpc-encoding":
            encoding = v
        elif k not in _SKIP:
            metadata.append((k, base64.b64decode(v + "==") if k.endswith("-bin") else v))
    problem: tuple[grpc.StatusCode, str] | None = None
    size = list_size(headers)
    if size > max_header_bytes:
        problem = (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"a header list of {size} bytes is over the limit of {max_header_bytes}",
        )
    elif (why := malformed(headers)) is not None:
        problem = grpc.StatusCode.INTERNAL, f"malformed request: {why}"
    return path, tuple(metadata), encoding, problem


class _Abort(grpc.aio.AbortError):  # type: ignore[misc]  # the servicer's decorator lets an AbortError through
    def __init__(self, code: grpc.StatusCode, details: str, trailing: Any = ()) -> None:
        super().__init__(details)
        self.code, self.details, self.trailing = code, details, trailing


class CallContext:
    """The part of ``grpc.aio.ServicerContext`` a servicer uses: ``abort``, ``invocation_metadata``, ``peer``,
    ``set_code``/``set_details``, ``set_trailing_metadata``."""

    def __init__(self, metadata: tuple[tuple[str, str | bytes], ...], peer: str, state: Any = None) -> None:
        self._metadata = metadata
        self._peer = peer
        self.state = state
        """What the server's ``admit`` hook returned for this call (e.g. the caller's principal)."""
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.trailing: Any = ()

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        raise _Abort(code, details, trailing_metadata or self.trailing)

    def set_trailing_metadata(self, metadata: Any) -> None:
        self.trailing = tuple(metadata)

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


@dataclass(frozen=True, slots=True)
class Method:
    parse: Callable[[bytes], Any] | None
    """The request message's decoder; None: a raw method, called with the message's bytes, answering bytes."""
    call: Callable[..., Any]
    streaming: bool


Metadata: TypeAlias = tuple[tuple[str, str | bytes], ...]
Refusal: TypeAlias = tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]
"""Why a call is refused: its status, details and trailing metadata."""
Admit: TypeAlias = Callable[[str, Metadata], Any]
"""``admit(path, metadata)``, before the message is read: a :data:`Refusal` tuple ends the call; anything else
is the call's ``context.state``."""
Gate: TypeAlias = Callable[[str, Any, bytes], Any]
"""``gate(path, state, message)``, once a unary call's whole message has arrived, in the frame handling itself
(no task yet): a :data:`Refusal` tuple ends the call with a trailers-only answer queued in this loop turn's
write, the method never called; anything else becomes the call's ``context.state``."""


def methods(servicer: InferenceServicer) -> dict[str, Method]:
    """Every method of the service, by HTTP/2 path."""
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    out = {}
    for m in service.methods:
        request_type = getattr(pb, m.input_type.name)
        streaming = m.client_streaming or m.server_streaming
        out[f"/{service.full_name}/{m.name}"] = Method(_lenient(request_type), getattr(servicer, m.name), streaming)
    return out


@dataclass(slots=True)
class _Stream:
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


class Http2Connection(asyncio.Protocol):
    """One client connection. Every frame is handled on the loop; each call runs as a task."""

    def __init__(self, server: Http2Server) -> None:
        self._server = server
        self._methods = server.methods
        self._max_message = server.max_message_bytes
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._preface = False
        self._max_headers = server.max_header_bytes
        self._decoder = hpack.Decoder(max_header_list_size=server.max_header_bytes * HEADER_LIST_BOMB_FACTOR)
        self._decoded: dict[bytes, list[tuple[str, str]]] = {}  # see _decode
        self._calls: dict[bytes, Call] = {}
        """A kept block's call (path, metadata, grpc-encoding, refusal), cleared with ``_decoded``."""
        self._streams: dict[int, _Stream] = {}
        self._send_window = 65535
        self._initial_window = 65535
        self._max_frame = DEFAULT_FRAME
        self._received = 0  # DATA bytes since our last connection WINDOW_UPDATE
        self._last_stream = 0
        self._continuation: _Stream | None = None
        self._going_away = False
        self._peer = "unknown"
        self._out = TurnOutput(lambda: self._transport)  # frames to send at the end of this loop turn
        self._opened = 0.0  # loop time of the connection's start
        self._idle_since = 0.0  # loop time since which no stream is open
        self.pings = 0  # PINGs since the server's last sweep

    # ---- asyncio.Protocol --------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple):
            self._peer = f"ipv4:{peer[0]}:{peer[1]}"
        self._server.connections.add(self)
        if len(self._server.connections) > self._server.max_connections:
            self._server.refused += 1
            transport.abort()
            return
        self._opened = self._idle_since = self._server.now()
        # our settings: streams may send up to 2^31-1 without a per-stream WINDOW_UPDATE (message size is
        # bounded separately); the connection window is raised to the same by one WINDOW_UPDATE
        server = self._server
        settings = struct.pack(">HIHIHI", 0x4, MAX_WINDOW, 0x3, server.max_streams, 0x6, server.max_header_bytes)
        transport.write(frame(SETTINGS, 0, 0, settings) + frame(WINDOW_UPDATE, 0, 0, _U32.pack(MAX_WINDOW - 65535)))

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        for s in self._streams.values():
            if s.task is not None:
                s.task.cancel()
        self._streams.clear()
        self._transport = None

    def data_received(self, data: bytes) -> None:
        poke()
        buf = self._buffer
        buf += data
        if not self._preface:
            if len(buf) < len(PREFACE):
                if not PREFACE.startswith(bytes(buf)):
                    self._close()
                return
            if not buf.startswith(PREFACE):
                self._close()
                return
            del buf[: len(PREFACE)]
            self._preface = True
        try:
            consumed = read_frames(buf, self._server.max_frame_in, self._frame)
        except FrameTooLarge as e:
            self._goaway(FRAME_SIZE_ERROR, str(e))
            return
        except _ConnectionError as e:
            self._goaway(e.code, str(e))
            return
        del buf[:consumed]
        if self._received >= 2**20:
            self._write(frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._received)))
            self._received = 0

    # ---- frames ------------------------------------------------------------------------------------------
    def _frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if self._continuation is not None and kind != CONTINUATION:
            raise _ConnectionError(PROTOCOL_ERROR, "expected CONTINUATION")
        if kind == DATA:
            self._data(flags, sid, payload)
        elif kind == HEADERS:
            self._headers(flags, sid, payload)
        elif kind == CONTINUATION:
            s = self._continuation
            if s is None or s.id != sid or s.block is None:
                raise _ConnectionError(PROTOCOL_ERROR, "unexpected CONTINUATION")
            s.block += payload
            if flags & END_HEADERS:
                self._continuation = None
                self._header_block(s, bytes(s.block), s.remote_closed)
        elif kind == SETTINGS:
            if not flags & ACK:
                self._settings(payload)
        elif kind == PING:
            if not flags & ACK:
                self.pings += 1
                if self.pings > self._server.max_pings_per_s:
                    raise _ConnectionError(ENHANCE_YOUR_CALM, "too many pings")
                self._write(frame(PING, ACK, 0, payload))
        elif kind == WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif kind == RST_STREAM:
            s = self._streams.pop(sid, None)
            if s is not None and s.task is not None:
                s.task.cancel()
        elif kind == GOAWAY:
            self._going_away = True
            if not self._streams:
                self._close()
        elif kind == PUSH_PROMISE:
            raise _ConnectionError(PROTOCOL_ERROR, "clients cannot push")
        # PRIORITY and unknown frame types are ignored (RFC 9113 5.5)

    def _headers(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0 or sid % 2 == 0:
            raise _ConnectionError(PROTOCOL_ERROR, f"HEADERS on stream {sid}")
        start, end = 0, len(payload)
        if flags & PADDED:
            end -= payload[0]
            start = 1
        if flags & PRIORITY_FLAG:
            start += 5
        if start > end:
            raise _ConnectionError(PROTOCOL_ERROR, "padding longer than the frame")
        block = payload[start:end]
        s = self._streams.get(sid)
        if s is None:
            if sid <= self._last_stream:
                raise _ConnectionError(PROTOCOL_ERROR, f"stream {sid} is closed")
            self._last_stream = sid
            s = self._streams[sid] = _Stream(sid, self._initial_window)
        closed = bool(flags & END_STREAM)
        if flags & END_HEADERS:
            self._header_block(s, block, closed)
        else:
            s.block = bytearray(block)
            s.remote_closed = closed
            self._continuation = s

    def _header_block(self, s: _Stream, block: bytes, closed: bool) -> None:
        s.block = None
        try:
            headers = self._decode(block)
        except hpack.HPACKError as e:
            raise _ConnectionError(COMPRESSION_ERROR, str(e)) from None
        if s.headers_done:  # the client's trailers: only the end of the stream matters
            if closed:
                self._end_of_input(s)
            return
        s.headers_done = True
        call = self._calls.get(block)
        if call is None:  # a kept block's headers are read once
            call = read_call(headers, self._max_headers)
            if block in self._decoded:
                self._calls[block] = call
        path, s.metadata, encoding, problem = call
        if len(self._streams) > self._server.max_streams:  # more than our SETTINGS allowed
            self._streams.pop(s.id, None)
            self._write(frame(RST_STREAM, 0, s.id, _U32.pack(REFUSED_STREAM)))
            return
        if problem is not None:  # refused on its stream: the connection (maybe shared by many callers) goes on
            self._fail(s, problem[0], problem[1], reset=not closed)
            return
        s.method = self._methods.get(path)
        s.path = path
        if s.method is None:
            self._fail(s, grpc.StatusCode.UNIMPLEMENTED, f"method {path} is not implemented", reset=not closed)
            return
        admit = self._server.admit
        if admit is not None:
            verdict = admit(path, s.metadata)
            if type(verdict) is tuple:  # refused on its metadata alone: the message is never read
                code, details, trailing = verdict
                self._fail(s, code, details, reset=not closed, extra=metadata_block(trailing))
                return
            s.state = verdict
        if encoding != "identity":
            self._fail(s, grpc.StatusCode.UNIMPLEMENTED, f"grpc-encoding {encoding} is not supported; use identity")
            return
        if self._going_away:
            self._fail(s, grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
            return
        if s.method.streaming:
            s.inbox = asyncio.Queue()
            s.task = asyncio.get_running_loop().create_task(self._streaming(s))
        if closed:
            self._end_of_input(s)

    def _decode(self, block: bytes) -> list[tuple[str, str]]:
        """HPACK-decode a header block. A client repeats its blocks (after the first calls, references into the
        dynamic table): a block whose decoding left the table as it was is kept, and the same bytes decode to
        the same headers as long as the table does not change (any change forgets every kept block)."""
        kept = self._decoded.get(block)
        if kept is not None:
            return kept
        table = self._decoder.header_table
        entries = table.dynamic_entries
        first, count, size = entries[0] if entries else None, len(entries), table.maxsize
        headers = cast(list[tuple[str, str]], self._decoder.decode(block))
        if (entries[0] if entries else None) is first and len(entries) == count and table.maxsize == size:
            if len(self._decoded) < 64:
                self._decoded[block] = headers
        else:
            self._decoded.clear()
            self._calls.clear()
        return headers

    def _data(self, flags: int, sid: int, payload: bytes) -> None:
        self._received += len(payload)
        s = self._streams.get(sid)
        if s is None:
            return  # a stream we reset or finished: its data still counted for the connection window
        if not s.headers_done:
            raise _ConnectionError(PROTOCOL_ERROR, f"DATA before HEADERS on stream {sid}")
        start, end = 0, len(payload)
        if flags & PADDED:
            end -= payload[0]
            start = 1
        data = s.data
        data += payload[start:end] if start or end != len(payload) else payload
        if s.inbox is None and len(data) >= 5 and max(_U32.unpack_from(data, 1)[0], len(data) - 5) > self._max_message:
            # the length prefix says more than the limit: refused before the message's body is taken in
            self._fail(
                s,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the request message is over the limit of {self._max_message} bytes",
                reset=not flags & END_STREAM,
            )
            return
        if s.inbox is not None:
            self._deliver(s)
        if flags & END_STREAM:
            self._end_of_input(s)

    def _deliver(self, s: _Stream) -> None:
        """Streaming: hand each complete message to the call."""
        assert s.inbox is not None
        while len(s.data) >= 5:
            n = _U32.unpack_from(s.data, 1)[0]
            if n > self._max_message:
                self._fail(s, grpc.StatusCode.RESOURCE_EXHAUSTED, f"a message of {n} bytes is over the limit")
                return
            if len(s.data) < 5 + n:
                return
            s.inbox.put_nowait(bytes(s.data[5 : 5 + n]))
            del s.data[: 5 + n]

    def _end_of_input(self, s: _Stream) -> None:
        s.remote_closed = True
        if s.method is None or s.error:
            return
        if s.inbox is not None:
            s.inbox.put_nowait(None)
            return
        data = s.data
        if len(data) < 5 or _U32.unpack_from(data, 1)[0] != len(data) - 5:
            self._fail(s, grpc.StatusCode.INTERNAL, "a unary call needs exactly one request message")
            return
        if data[0]:
            self._fail(s, grpc.StatusCode.UNIMPLEMENTED, "compressed messages are not supported")
            return
        server = self._server
        if server.calls >= server.max_calls:
            self._fail(s, grpc.StatusCode.RESOURCE_EXHAUSTED, f"more than {server.max_calls} calls in progress")
            return
        with memoryview(data) as view:
            message = bytes(view[5:])  # one copy (a slice of the bytearray first would be two)
        s.data = bytearray()
        gate = server.gate
        if gate is not None:
            verdict = gate(s.path, s.state, message)
            if type(verdict) is tuple:  # refused before any task: one HEADERS frame, in this turn's write
                code, details, trailing = verdict
                self._fail(s, code, details, extra=metadata_block(trailing))
                return
            s.state = verdict
        s.task = task = asyncio.get_running_loop().create_task(self._unary(s, message))
        release = server.release
        if release is not None:  # also when the task is cancelled before it started
            state = s.state
            task.add_done_callback(lambda _: release(state))

    def _settings(self, payload: bytes) -> None:
        if len(payload) % 6:
            raise _ConnectionError(FRAME_SIZE_ERROR, "SETTINGS length not a multiple of 6")
        for i in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, i)
            if key == 0x4:
                if value > MAX_WINDOW:
                    raise _ConnectionError(FLOW_CONTROL_ERROR, "initial window over 2^31-1")
                delta, self._initial_window = value - self._initial_window, value
                for s in self._streams.values():
                    s.send_window += delta
            elif key == 0x5:
                if not DEFAULT_FRAME <= value < 2**24:
                    raise _ConnectionError(PROTOCOL_ERROR, f"max frame size {value}")
                self._max_frame = value
            # HEADER_TABLE_SIZE bounds our encoder's table, which we never use (literals without indexing)
        self._write(frame(SETTINGS, ACK, 0))
        self._flush_all()

    def _window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise _ConnectionError(FRAME_SIZE_ERROR, "WINDOW_UPDATE of the wrong size")
        increment = _U32.unpack(payload)[0] & MAX_WINDOW
        if sid == 0:
            self._send_window += increment
            if self._send_window > MAX_WINDOW:
                raise _ConnectionError(FLOW_CONTROL_ERROR, "connection window over 2^31-1")
            self._flush_all()
        elif (s := self._streams.get(sid)) is not None:
            s.send_window += increment
            self._flush(s)

    # ---- calls -------------------------------------------------------------------------------------------
    async def _unary(self, s: _Stream, message: bytes) -> None:
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
        except _Abort as a:
            self._fail(s, a.code, a.details, extra=metadata_block(a.trailing))
            return
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._fail_with(s, e)
            return
        finally:
            server.calls -= 1
        extra = metadata_block(context.trailing)
        if context.code is not None and context.code is not grpc.StatusCode.OK:
            self._fail(s, context.code, context.details, extra=extra)
            return
        self._respond(s, b"\x00" + _U32.pack(len(out)) + out, extra + _OK_TRAILERS)

    async def _streaming(self, s: _Stream) -> None:
        method = s.method
        assert method is not None and s.inbox is not None
        inbox = s.inbox
        context = CallContext(s.metadata, self._peer, s.state)
        parse = method.parse or bytes

        async def requests() -> AsyncIterator[Any]:
            while (message := await inbox.get()) is not None:
                yield parse(message)

        try:
            async for response in method.call(requests(), context):
                out = response if method.parse is None else response.SerializeToString()
                self._respond(s, b"\x00" + _U32.pack(len(out)) + out, None)
        except _Abort as a:
            self._fail(s, a.code, a.details, extra=metadata_block(a.trailing))
            return
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._fail_with(s, e)
            return
        self._respond(s, b"", metadata_block(context.trailing) + _OK_TRAILERS)

    def _fail_with(self, s: _Stream, error: Exception) -> None:
        code = code_of(error)
        if code is grpc.StatusCode.INTERNAL and not isinstance(error, ModelExecutionError):
            log.exception("internal error", exc_info=error)
        self._fail(s, code, str(error))

    # ---- output ------------------------------------------------------------------------------------------
    def _respond(self, s: _Stream, data: bytes, trailers: bytes | None) -> None:
        """Send response headers (once), ``data`` as DATA frames and, if given, the trailers ending the stream,
        in one write when the windows allow; what they do not allow waits for WINDOW_UPDATE."""
        if self._transport is None or self._streams.get(s.id) is not s:
            return
        out = b""
        if not s.sent_headers:
            s.sent_headers = True
            out = frame(HEADERS, END_HEADERS, s.id, _RESPONSE_HEADERS)
        s.pending += data
        if trailers is not None:
            s.pending_trailers = trailers
        self._flush(s, out)

    def _flush(self, s: _Stream, out: bytes = b"") -> None:
        if out:
            self._write(out)
        pending = s.pending
        while pending:  # each frame joins this loop turn's one write (a bytearray: linear in the message's size)
            n = min(len(pending), self._max_frame, self._send_window, s.send_window)
            if n <= 0:
                break
            self._write(frame(DATA, 0, s.id, bytes(pending[:n])))
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

    def _fail(self, s: _Stream, code: grpc.StatusCode, message: str, reset: bool = False, extra: bytes = b"") -> None:
        """End the call with ``code``: trailers-only if nothing was sent yet (and RST_STREAM if asked, when the
        client is still sending)."""
        s.error = s.error or message or code.name
        if self._transport is None or self._streams.get(s.id) is not s:
            return
        s.pending.clear()
        if s.sent_headers:
            out = frame(HEADERS, END_HEADERS | END_STREAM, s.id, _trailers(code, message, extra))
        else:
            block = _RESPONSE_HEADERS + _trailers(code, message, extra)
            out = frame(HEADERS, END_HEADERS | END_STREAM, s.id, block)
        if reset and not s.remote_closed:
            out += frame(RST_STREAM, 0, s.id, _U32.pack(NO_ERROR))
        self._write(out)
        if s.task is not None and s.task is not asyncio.current_task():
            s.task.cancel()
        self._finished(s)

    def _finished(self, s: _Stream) -> None:
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
        log.info("closing an HTTP/2 connection from %s: %s", self._peer, reason)
        self._write(frame(GOAWAY, 0, 0, _U32.pack(self._last_stream) + _U32.pack(code) + reason.encode()[:200]))
        self._close()

    def _close(self) -> None:
        if self._transport is not None:
            self._out.flush()
            self._transport.close()

    def shut_down(self) -> None:
        """Refuse new calls (GOAWAY), finish those in flight, then close."""
        self._going_away = True
        self._write(frame(GOAWAY, 0, 0, _U32.pack(self._last_stream) + _U32.pack(NO_ERROR)))
        if not self._streams:
            self._close()

    @property
    def busy(self) -> bool:
        return bool(self._streams)

    def sweep(self, now: float) -> None:
        """The server's periodic check: a preface too late, a connection idle too long, the ping count reset."""
        self.pings = 0
        server = self._server
        if not self._preface and now - self._opened > server.header_timeout_s:
            self._close()
        elif not self._streams and now - self._idle_since > server.idle_timeout_s:
            self._goaway(NO_ERROR, "idle")


class _ConnectionError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class Http2Server:
    """gRPC over HTTP/2 for a set of methods (by path), on the running event loop."""

    def __init__(
        self,
        methods: Mapping[str, Method],
        *,
        admit: Admit | None = None,
        gate: Gate | None = None,
        release: Callable[[Any], None] | None = None,
        max_message_bytes: int = 64 * 2**20,
        max_streams: int = 1024,
        max_calls: int = 2**31,
        max_connections: int = 2**31,
        header_timeout_s: float = 3600.0,
        idle_timeout_s: float = 86400.0,
        max_pings_per_s: int = 1000,
        max_header_bytes: int = REPLICA_MAX_HEADER_BYTES,
    ) -> None:
        self.methods = dict(methods)
        self.admit = admit
        self.gate = gate
        """Unary calls: see :data:`Gate`."""
        self.release = release
        """``release(state)`` once a unary call that passed the gate has finished, however it ended (the
        gate's state, e.g. a slot it reserved)."""
        self.max_message_bytes = max_message_bytes
        self.max_streams = max_streams
        """Concurrent streams per connection (our SETTINGS_MAX_CONCURRENT_STREAMS; more are REFUSED_STREAM)."""
        self.max_calls = max_calls
        """Calls in progress over all connections; more are RESOURCE_EXHAUSTED."""
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        """From a connection's start to the end of the client's preface."""
        self.idle_timeout_s = idle_timeout_s
        """A connection with no call for this long is sent GOAWAY and closed."""
        self.max_pings_per_s = max_pings_per_s
        self.max_header_bytes = max_header_bytes
        """A call's header list as HTTP/2 counts it (our SETTINGS_MAX_HEADER_LIST_SIZE); a larger one is refused
        RESOURCE_EXHAUSTED on its stream (see ``protocols.headers`` for each hop's)."""
        self.max_frame_in = DEFAULT_FRAME  # we advertise no larger SETTINGS_MAX_FRAME_SIZE
        self.connections: set[Http2Connection] = set()
        self.calls = 0
        self.refused = 0
        """Connections closed on arrival because ``max_connections`` were open."""
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.now: Callable[[], float] = lambda: 0.0

    async def start(
        self,
        host: str,
        port: int,
        ssl: _ssl.SSLContext | None = None,
        reuse_port: bool = False,
        sock: socket.socket | None = None,
    ) -> int:
        """Listen on ``host:port`` (0: a free port), over TLS when ``ssl`` is given (it must offer ALPN ``h2``:
        :func:`server_ssl_context`); ``reuse_port``: share the port with other processes (``SO_REUSEPORT``);
        ``sock``: listen on this bound socket instead (``host`` and ``port`` are then ignored). Returns the port."""
        loop = asyncio.get_running_loop()
        self.now = loop.time
        handshake = min(self.header_timeout_s, HANDSHAKE_TIMEOUT_S)
        tls: dict[str, Any] = {"ssl": ssl, "ssl_handshake_timeout": handshake} if ssl is not None else {}
        try:
            if sock is not None:
                self._server = await loop.create_server(lambda: Http2Connection(self), sock=sock, **tls)
            else:
                self._server = await loop.create_server(
                    lambda: Http2Connection(self), host, port, reuse_address=True, reuse_port=reuse_port or None, **tls
                )
        except OSError as e:
            raise OSError(f"cannot bind the gRPC port {host}:{port}: {e.strerror}") from None
        self._sweeper = loop.create_task(self._sweep())
        sock = self._server.sockets[0]
        return int(sock.getsockname()[1])

    async def _sweep(self) -> None:
        interval = min(1.0, self.header_timeout_s / 2, self.idle_timeout_s / 2)
        while True:
            await asyncio.sleep(interval)
            now = self.now()
            for c in list(self.connections):
                c.sweep(now)

    async def stop(self, grace_s: float) -> None:
        """Stop listening, tell every client to go away, give calls in flight ``grace_s`` to finish."""
        if self._server is None:
            return
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self._server.close()
        for c in list(self.connections):
            c.shut_down()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while any(c.busy for c in self.connections) and loop.time() < deadline:
            await asyncio.sleep(0.01)
        for c in list(self.connections):
            c._close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 1)
        self._server = None


class GrpcServer(Http2Server):
    """Triton's gRPC service over one :class:`DataPlane`, on the running event loop."""

    def __init__(
        self,
        dataplane: DataPlane,
        *,
        max_message_bytes: int = 64 * 2**20,
        max_streams: int = 1024,
        extra: Mapping[str, Method] | None = None,
        secret: bytes | None = None,
        replica_id: str = "",
    ) -> None:
        super().__init__(
            {**methods(InferenceServicer(dataplane, trust_tenant=secret is not None)), **(extra or {})},
            admit=None if secret is None else require_secret(secret, replica_id),
            max_message_bytes=max_message_bytes,
            max_streams=max_streams,
        )
        self.secret = secret
        """The cloud's internal secret: every call but ServerLive/ServerReady must carry it (protocols/internal.py);
        a call meant for another replica than ``replica_id`` is UNAVAILABLE (the caller tries another)."""


def require_secret(secret: bytes, replica_id: str = "") -> Admit:
    """The admission of a replica of a cloud: calls without the secret are UNAUTHENTICATED (but ServerLive and
    ServerReady), calls meant for another replica than ``replica_id`` UNAVAILABLE."""
    refused: Refusal = (grpc.StatusCode.UNAUTHENTICATED, REFUSED, ())

    def admit(path: str, metadata: Metadata) -> Refusal | None:
        if path not in OPEN_GRPC_METHODS:
            presented = next((v for k, v in metadata if k == SECRET_HEADER), None)
            if not matches(secret, presented):
                return refused
        wrong = misdirected(replica_id, metadata)
        return None if wrong is None else (grpc.StatusCode.UNAVAILABLE, wrong, ())

    return admit


def server_ssl_context(certfile: str, keyfile: str, client_ca: str | None = None) -> ssl.SSLContext:
    """A TLS server context for gRPC: ALPN ``h2``, TLS 1.2 or later, client certificates required when
    ``client_ca`` is given."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(certfile, keyfile)
    if client_ca is not None:
        context.load_verify_locations(client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    context.set_alpn_protocols(["h2"])
    return context


__all__ = [
    "Admit",
    "CallContext",
    "Gate",
    "GrpcServer",
    "Http2Server",
    "Method",
    "Refusal",
    "metadata_block",
    "methods",
    "server_ssl_context",
]
