"""A raw HTTP/2 client for tests that play the attacker: frames written as they are given (any header name, any
order, any size), answers read back as frames. HPACK from the ``hpack`` package, as a real client encodes.

``H2Wire`` runs on asyncio; :func:`exchange` is the blocking form for tests that drive a cloud from a thread.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
SERVICE = "/inference.GRPCInferenceService/"


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream) + payload


def grpc_headers(path: str, metadata: Sequence[tuple[str, str]] = (), encoder: hpack.Encoder | None = None) -> bytes:
    """A gRPC call's header block: the pseudo-headers and ``metadata`` with names exactly as given."""
    fields = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "gateway"),
              ("content-type", "application/grpc"), ("te", "trailers"), *metadata]  # fmt: skip
    return (encoder or hpack.Encoder()).encode(fields)


def message(body: bytes) -> bytes:
    """One gRPC message: the 5-byte length prefix and ``body``."""
    return b"\x00" + struct.pack(">I", len(body)) + body


def header_frames(stream: int, block: bytes, flags: int = 0, size: int = 16384) -> bytes:
    """A header block as HEADERS and as many CONTINUATION frames of ``size`` as it takes."""
    if len(block) <= size:
        return frame(HEADERS, flags | END_HEADERS, stream, block)
    out = frame(HEADERS, flags, stream, block[:size])
    for i in range(size, len(block), size):
        out += frame(CONTINUATION, END_HEADERS if i + size >= len(block) else 0, stream, block[i : i + size])
    return out


def call(stream: int, path: str, metadata: Sequence[tuple[str, str]], body: bytes) -> bytes:
    """The frames of one unary call: its header block, then the message in DATA frames of 16 KiB ending the
    stream."""
    out = header_frames(stream, grpc_headers(path, metadata))
    wire = message(body)
    for i in range(0, len(wire), 16384):
        out += frame(DATA, END_STREAM if i + 16384 >= len(wire) else 0, stream, wire[i : i + 16384])
    return out


@dataclass(frozen=True, slots=True)
class Frame:
    kind: int
    flags: int
    stream: int
    payload: bytes


def parse(data: bytes) -> list[Frame]:
    out, pos = [], 0
    while len(data) - pos >= 9:
        n = int.from_bytes(data[pos : pos + 3], "big")
        if len(data) - pos < 9 + n:
            break
        sid = int.from_bytes(data[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
        out.append(Frame(data[pos + 3], data[pos + 4], sid, data[pos + 9 : pos + 9 + n]))
        pos += 9 + n
    return out


def statuses(frames: Iterable[Frame]) -> dict[int, dict[str, str]]:
    """Stream → the headers the server sent on it (response headers and trailers merged), decoded in order."""
    decoder = hpack.Decoder(max_header_list_size=2**24)
    out: dict[int, dict[str, str]] = {}
    for f in frames:
        if f.kind == HEADERS:
            out.setdefault(f.stream, {}).update(dict(decoder.decode(f.payload)))
    return out


def goaway(frames: Iterable[Frame]) -> tuple[int, bytes] | None:
    """The error code and debug data of the server's GOAWAY, if it sent one."""
    for f in frames:
        if f.kind == GOAWAY:
            return struct.unpack(">I", f.payload[4:8])[0], f.payload[8:]
    return None


class H2Wire:
    """One raw connection: ``send`` what you like, ``read`` what comes back."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.received = b""

    @classmethod
    async def open(cls, port: int, preface: bool = True) -> H2Wire:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        wire = cls(reader, writer)
        if preface:
            await wire.send(PREFACE + frame(SETTINGS, 0, 0))
        return wire

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def read(self, until_closed_or_s: float = 2.0) -> list[Frame]:
        """What arrives until the server closes the connection or ``until_closed_or_s`` pass without a byte."""
        while True:
            try:
                chunk = await asyncio.wait_for(self.reader.read(2**20), until_closed_or_s)
            except (TimeoutError, ConnectionError):
                break
            if not chunk:
                break
            self.received += chunk
        return parse(self.received)

    async def read_until(self, done: object, limit_s: float = 30.0) -> list[Frame]:
        """Read until ``done(frames)`` holds (or the connection closes); ``limit_s`` only ends a test that would
        hang."""
        assert callable(done)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit_s
        while not done(parse(self.received)) and loop.time() < deadline:
            try:
                chunk = await asyncio.wait_for(self.reader.read(2**20), max(0.01, deadline - loop.time()))
            except (TimeoutError, ConnectionError):
                break
            if not chunk:
                break
            self.received += chunk
        return parse(self.received)

    def close(self) -> None:
        self.writer.transport.abort()


def exchange(port: int, wire: bytes, until_closed_or_s: float = 2.0) -> list[Frame]:
    """Blocking: open a connection, send the preface, SETTINGS and ``wire``, return every frame answered."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(PREFACE + frame(SETTINGS, 0, 0) + wire)
        sock.settimeout(until_closed_or_s)
        got = b""
        try:
            while chunk := sock.recv(2**20):
                got += chunk
        except (TimeoutError, ConnectionError):
            pass
    return parse(got)
