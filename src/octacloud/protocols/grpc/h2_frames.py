"""HTTP/2 framing and the header fields of gRPC, for octacloud's HTTP/2 server (``h2.py``) and client
(``h2_client.py``): frame types and flags, reading and writing frames, one loop turn's output as one write,
HPACK literals, and what a request's header block asks for (RFC 9113, RFC 7541, the gRPC HTTP/2 protocol)."""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import Callable
from typing import Any, TypeAlias
from urllib.parse import quote

import grpc

from octacloud.protocols.headers import list_size

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL = 0, 1, 3, 6, 7, 8
COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 9, 11
MAX_WINDOW = 2**31 - 1
DEFAULT_FRAME = 2**14
_HEADER = struct.Struct(">BHBBI")  # 9-byte frame header: length (24 bits as 8 + 16), type, flags, stream
U32 = struct.Struct(">I")
# :status 200 (static index 8) and content-type: application/grpc (literal, static name 31, not indexed)
RESPONSE_HEADERS = b"\x88\x0f\x10\x10application/grpc"
OK_TRAILERS = b"\x00\x0bgrpc-status\x010"
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

    def queued(self) -> int:
        """Bytes queued this turn, not yet handed to the transport."""
        return len(self._buffer)

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


def read_frames(
    buf: bytearray,
    max_length: int,
    on_frame: Callable[[int, int, int, bytes], None],
    more: Callable[[], bool] | None = None,
) -> int:
    """Hand each whole frame at the start of ``buf`` to ``on_frame(kind, flags, stream, payload)``, in order,
    while ``more()`` holds (checked before each frame; the rest waits in ``buf``); returns how many bytes they
    took (the caller drops them; a partial frame stays). Raises :class:`FrameTooLarge` for a frame over
    ``max_length``, and whatever ``on_frame`` raises."""
    pos, end = 0, len(buf)
    view = memoryview(buf)
    try:
        while end - pos >= 9 and (more is None or more()):
            length = (buf[pos] << 16) | (buf[pos + 1] << 8) | buf[pos + 2]
            if length > max_length:
                raise FrameTooLarge(f"a frame of {length} bytes")
            if end - pos < 9 + length:
                break
            kind, flags = buf[pos + 3], buf[pos + 4]
            stream = U32.unpack_from(buf, pos + 5)[0] & MAX_WINDOW
            payload = bytes(view[pos + 9 : pos + 9 + length])
            pos += 9 + length
            on_frame(kind, flags, stream, payload)
    finally:
        view.release()  # before the caller resizes the buffer
    return pos


def literal(name: bytes, value: bytes) -> bytes:
    """A header field as a literal without indexing, new name, no Huffman (RFC 7541 6.2.2)."""
    return b"\x00" + int7(len(name)) + name + int7(len(value)) + value


def int7(n: int) -> bytes:
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
        out += literal(key.lower().encode(), raw)
    return out


def trailers(code: grpc.StatusCode, message: str, extra: bytes = b"") -> bytes:
    block = extra + literal(b"grpc-status", str(code.value[0]).encode())
    if len(message) > MAX_STATUS_MESSAGE:
        message = message[: MAX_STATUS_MESSAGE - 3] + "..."
    if message:
        block += literal(b"grpc-message", quote(message, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~").encode())
    return block


Call: TypeAlias = tuple[str, tuple[tuple[str, str | bytes], ...], str, tuple[grpc.StatusCode, str] | None, int]
"""What a request's header block says: its path, metadata, ``grpc-encoding``, why it is refused (or None), and
its header list's size as HTTP/2 counts it."""


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
    return path, tuple(metadata), encoding, problem, size


__all__ = [
    "ACK",
    "CANCEL",
    "COMPRESSION_ERROR",
    "CONTINUATION",
    "DATA",
    "DEFAULT_FRAME",
    "END_HEADERS",
    "END_STREAM",
    "ENHANCE_YOUR_CALM",
    "FLOW_CONTROL_ERROR",
    "FRAME_SIZE_ERROR",
    "GOAWAY",
    "HEADERS",
    "MAX_STATUS_MESSAGE",
    "MAX_WINDOW",
    "NO_ERROR",
    "OK_TRAILERS",
    "PADDED",
    "PING",
    "PREFACE",
    "PRIORITY",
    "PRIORITY_FLAG",
    "PROTOCOL_ERROR",
    "PUSH_PROMISE",
    "REFUSED_STREAM",
    "RESPONSE_HEADERS",
    "RST_STREAM",
    "SETTINGS",
    "U32",
    "WINDOW_UPDATE",
    "Call",
    "FrameTooLarge",
    "TurnOutput",
    "frame",
    "int7",
    "literal",
    "malformed",
    "metadata_block",
    "read_call",
    "read_frames",
    "trailers",
]
