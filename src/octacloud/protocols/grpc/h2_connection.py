"""One client connection of octacloud's HTTP/2 server (``h2.py``): the reading half, frames in the order they
come, every one handled on the loop; each call runs as a task (``h2_output``, the answering half). What a
client may cost before its calls complete, and the frames it may send that carry no call, are bounded as
``h2_limits`` says."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from typing import TYPE_CHECKING, cast

import grpc
import hpack

from octacloud.idlespin import poke
from octacloud.protocols.grpc.h2_calls import Method
from octacloud.protocols.grpc.h2_frames import (
    ACK,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    MAX_WINDOW,
    NO_ERROR,
    PADDED,
    PING,
    PREFACE,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    U32,
    WINDOW_UPDATE,
    Call,
    FrameTooLarge,
    frame,
    metadata_block,
    read_call,
    read_frames,
)
from octacloud.protocols.grpc.h2_output import LINGER_S, ConnectionFault, ConnectionOutput, Stream
from octacloud.protocols.headers import HEADER_LIST_BOMB_FACTOR

if TYPE_CHECKING:
    from octacloud.protocols.grpc.h2 import Http2Server


class Http2Connection(ConnectionOutput, asyncio.Protocol):
    """One client connection. Every frame is handled on the loop; each call runs as a task."""

    def __init__(self, server: Http2Server) -> None:
        super().__init__(server)
        self._methods: dict[str, Method] = server.methods
        self._max_message = server.max_message_bytes
        self._buffer = bytearray()
        self._preface = False
        self._max_headers = server.max_header_bytes
        self._max_continuations = server.limits.max_continuations(server.max_header_bytes)
        self._max_queued = server.limits.max_queued_output
        self._decoder = hpack.Decoder(max_header_list_size=server.max_header_bytes * HEADER_LIST_BOMB_FACTOR)
        self._decoded: dict[bytes, list[tuple[str, str]]] = {}  # see _decode
        self._calls: dict[bytes, Call] = {}
        """A kept block's call (path, metadata, grpc-encoding, refusal, size), cleared with ``_decoded``."""
        self._received = 0  # DATA bytes since our last connection WINDOW_UPDATE
        self._continuation: Stream | None = None
        self._block_frames = 0  # CONTINUATION frames of the block in progress
        self._block_since = 0.0  # loop time of the HEADERS frame that started it
        self._opened = 0.0  # loop time of the connection's start
        self._held_back = False  # frames wait in the buffer until the output drains
        self._writing_paused = False
        self._progress: tuple[int, int, int] = (0, 0, 0)  # output's progress at the last sweep
        self._stalled_since: float | None = None

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
        transport.set_write_buffer_limits(high=self._max_queued, low=self._max_queued // 4)
        # our settings: streams may send up to 2^31-1 without a per-stream WINDOW_UPDATE (what they may hold is
        # bounded separately, h2_limits); the connection window is raised to the same by one WINDOW_UPDATE
        server = self._server
        settings = struct.pack(">HIHIHI", 0x4, MAX_WINDOW, 0x3, server.max_streams, 0x6, server.max_header_bytes)
        transport.write(frame(SETTINGS, 0, 0, settings) + frame(WINDOW_UPDATE, 0, 0, U32.pack(MAX_WINDOW - 65535)))

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        for s in self._streams.values():
            self._unhold(s)
            if s.task is not None:
                s.task.cancel()
        self._streams.clear()
        self._buffer = bytearray()
        self._transport = None

    def pause_writing(self) -> None:
        """The transport holds more than ``max_queued_output``: stop reading until the client takes it."""
        self._writing_paused = True
        self._pause_reading()

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._resume()

    def data_received(self, data: bytes) -> None:
        poke()
        if self._closed_at is not None:  # lingering after GOAWAY: dropped
            return
        self._buffer += data
        self._read()

    def _read(self) -> None:
        """Handle the whole frames in the buffer while the output queued stays within ``max_queued_output``;
        past it, the rest waits (and the socket is not read) until the client has taken the output."""
        buf = self._buffer
        if self._closed_at is not None:
            return
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
            consumed = read_frames(buf, self._server.max_frame_in, self._frame, self._may_read)
        except FrameTooLarge as e:
            self._goaway(FRAME_SIZE_ERROR, str(e))
            return
        except ConnectionFault as e:
            self._goaway(e.code, str(e))
            return
        del buf[:consumed]
        if self._received >= 2**20:
            self._write(frame(WINDOW_UPDATE, 0, 0, U32.pack(self._received)))
            self._received = 0
        if len(buf) >= 9 and not self._may_read():
            self._held_back = True
            self._pause_reading()
            asyncio.get_running_loop().call_soon(self._resume)  # after this turn's output is written

    def _may_read(self) -> bool:
        return self._out.queued() <= self._max_queued and self._transport is not None

    def _pause_reading(self) -> None:
        transport = self._transport
        if transport is not None and not transport.is_closing():
            with contextlib.suppress(RuntimeError):  # uvloop: a transport already closing
                transport.pause_reading()

    def _resume(self) -> None:
        """The output queued was written or taken: read on (unless the transport still holds too much)."""
        transport = self._transport
        if transport is None or self._writing_paused or transport.is_closing():
            return
        with contextlib.suppress(RuntimeError):
            transport.resume_reading()
        if self._held_back:
            self._held_back = False
            self._read()

    # ---- frames ------------------------------------------------------------------------------------------
    def _frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if self._continuation is not None and kind != CONTINUATION:
            raise ConnectionFault(PROTOCOL_ERROR, "expected CONTINUATION")
        budget = self._budget
        if payload and kind <= HEADERS:  # DATA or HEADERS with a payload: the hot path
            budget.empty = 0
        elif (why := budget.over(kind, flags, len(payload))) is not None:
            raise ConnectionFault(ENHANCE_YOUR_CALM, why)
        if kind == DATA:
            self._data(flags, sid, payload)
        elif kind == HEADERS:
            self._headers(flags, sid, payload)
        elif kind == CONTINUATION:
            self._more_block(flags, sid, payload)
        elif kind == SETTINGS:
            if not flags & ACK:
                self._settings(payload)
        elif kind == PING:
            if not flags & ACK:
                self._write(frame(PING, ACK, 0, payload))
        elif kind == WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif kind == RST_STREAM:
            s = self._streams.pop(sid, None)
            if s is not None:
                self._unhold(s)
                if s.task is not None:
                    s.task.cancel()
        elif kind == GOAWAY:
            self._going_away = True
            if not self._streams:
                self._close()
        elif kind == PUSH_PROMISE:
            raise ConnectionFault(PROTOCOL_ERROR, "clients cannot push")
        # PRIORITY and unknown frame types are ignored (RFC 9113 5.5), within the budget

    def _headers(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0 or sid % 2 == 0:
            raise ConnectionFault(PROTOCOL_ERROR, f"HEADERS on stream {sid}")
        start, end = 0, len(payload)
        if flags & PADDED:
            end -= payload[0]
            start = 1
        if flags & PRIORITY_FLAG:
            start += 5
        if start > end:
            raise ConnectionFault(PROTOCOL_ERROR, "padding longer than the frame")
        block = payload[start:end]
        s = self._streams.get(sid)
        if s is None:
            if sid <= self._last_stream:
                raise ConnectionFault(PROTOCOL_ERROR, f"stream {sid} is closed")
            self._last_stream = sid
            self._budget.opened += 1
            s = self._streams[sid] = Stream(sid, self._initial_window)
        closed = bool(flags & END_STREAM)
        if flags & END_HEADERS:
            self._header_block(s, block, closed)
            return
        if len(block) > self._max_headers:
            raise ConnectionFault(ENHANCE_YOUR_CALM, f"a header block over {self._max_headers} bytes")
        s.block = bytearray(block)
        s.remote_closed = closed
        self._continuation = s
        self._block_frames = 0
        self._block_since = self._server.now()

    def _more_block(self, flags: int, sid: int, payload: bytes) -> None:
        """A CONTINUATION frame: the block it continues stays within the header list limit in bytes as sent
        and in frames (``h2_limits``), checked as it grows."""
        s = self._continuation
        if s is None or s.id != sid or s.block is None:
            raise ConnectionFault(PROTOCOL_ERROR, "unexpected CONTINUATION")
        self._block_frames += 1
        if self._block_frames > self._max_continuations:
            raise ConnectionFault(ENHANCE_YOUR_CALM, f"a header block in more than {self._max_continuations} frames")
        if len(s.block) + len(payload) > self._max_headers:
            raise ConnectionFault(ENHANCE_YOUR_CALM, f"a header block over {self._max_headers} bytes")
        s.block += payload
        if flags & END_HEADERS:
            self._continuation = None
            self._header_block(s, bytes(s.block), s.remote_closed)

    def _header_block(self, s: Stream, block: bytes, closed: bool) -> None:
        s.block = None
        try:
            headers = self._decode(block)
        except hpack.HPACKError as e:
            raise ConnectionFault(COMPRESSION_ERROR, str(e)) from None
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
        path, s.metadata, encoding, problem, size = call
        if len(self._streams) > self._server.max_streams:  # more than our SETTINGS allowed
            self._streams.pop(s.id, None)
            self._write(frame(RST_STREAM, 0, s.id, U32.pack(REFUSED_STREAM)))
            return
        if problem is not None:  # refused on its stream: the connection (maybe shared by many callers) goes on
            self._fail(s, problem[0], problem[1], reset=not closed)
            return
        s.method = self._methods.get(path)
        s.path = path
        if s.method is None:
            self._fail(s, grpc.StatusCode.UNIMPLEMENTED, f"method {path} is not implemented", reset=not closed)
            return
        server = self._server
        if server.admit is not None:
            verdict = server.admit(path, s.metadata)
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
        if not closed and not self._wait_for_input(s, size):
            return
        if s.method.streaming:
            s.inbox = asyncio.Queue()
            s.task = asyncio.get_running_loop().create_task(self._streaming(s))
        if closed:
            self._end_of_input(s)

    def _wait_for_input(self, s: Stream, size: int) -> bool:
        """A call whose message is to come: counted among its owner's waiting calls, its metadata held on the
        budgets (``h2_limits``); False when a bound refused it."""
        server = self._server
        if server.owner is not None:  # a caller the hook cannot name (no key) is held to its connection's own
            owner = server.owner(s.state)
            s.owner = self if owner is None else owner
        why = self._inputs.open(s.owner)
        if why is None:
            s.waiting = True
            s.since = server.now()
            why = self._hold(s, size)
        if why is not None:
            self._fail(s, grpc.StatusCode.RESOURCE_EXHAUSTED, why, reset=True)
            return False
        return True

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
            raise ConnectionFault(PROTOCOL_ERROR, f"DATA before HEADERS on stream {sid}")
        start, end = 0, len(payload)
        if flags & PADDED:
            end -= payload[0]
            start = 1
        chunk = payload[start:end] if start or end != len(payload) else payload
        if chunk and s.method is not None and (why := self._hold(s, len(chunk))) is not None:
            self._fail(s, grpc.StatusCode.RESOURCE_EXHAUSTED, why, reset=not flags & END_STREAM)
            return
        data = s.data
        data += chunk
        limit = self._max_message if s.method is None else s.method.max_message_bytes or self._max_message
        if s.inbox is None and len(data) >= 5 and max(U32.unpack_from(data, 1)[0], len(data) - 5) > limit:
            # the length prefix says more than the limit: refused before the message's body is taken in
            self._fail(
                s,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the request message is over the limit of {limit} bytes",
                reset=not flags & END_STREAM,
            )
            return
        if s.inbox is not None:
            self._deliver(s, limit)
        if flags & END_STREAM:
            self._end_of_input(s)

    def _deliver(self, s: Stream, limit: int) -> None:
        """Streaming: hand each complete message to the call (held until the call takes it)."""
        assert s.inbox is not None
        while len(s.data) >= 5:
            n = U32.unpack_from(s.data, 1)[0]
            if n > limit:
                self._fail(s, grpc.StatusCode.RESOURCE_EXHAUSTED, f"a message of {n} bytes is over the limit")
                return
            if len(s.data) < 5 + n:
                return
            s.inbox.put_nowait(bytes(s.data[5 : 5 + n]))
            del s.data[: 5 + n]

    def _end_of_input(self, s: Stream) -> None:
        s.remote_closed = True
        if s.method is None or s.error:
            return
        if s.inbox is not None:
            if s.waiting:  # no more messages to wait for; those in the inbox stay held until taken
                s.waiting = False
                self._inputs.close(s.owner)
            s.inbox.put_nowait(None)
            return
        self._unhold(s)  # the message is the call's from here
        data = s.data
        if len(data) < 5 or U32.unpack_from(data, 1)[0] != len(data) - 5:
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

    # ---- the server's periodic check ---------------------------------------------------------------------
    def sweep(self, now: float) -> None:
        """A preface or header block too late, a call's message too late, output that does not move, a
        connection idle too long, one closed whose output nobody takes."""
        server, limits = self._server, self._server.limits
        transport = self._transport
        if transport is None:
            return
        if self._closed_at is not None:  # lingering after GOAWAY, or closing with output the client never takes
            linger = LINGER_S if self._lingering else limits.stall_timeout_s or server.header_timeout_s
            if now - self._closed_at > linger:
                transport.abort()
            return
        if not self._preface and now - self._opened > server.header_timeout_s:
            self._close()
        elif self._continuation is not None and now - self._block_since > server.header_timeout_s:
            self._goaway(ENHANCE_YOUR_CALM, f"a header block not ended within {server.header_timeout_s:g} s")
        elif not self._streams and now - self._idle_since > server.idle_timeout_s:
            self._goaway(NO_ERROR, "idle")
        elif self._stalled(now, transport):
            self._goaway(ENHANCE_YOUR_CALM, f"output not taken for {limits.stall_timeout_s:g} s")
            transport.abort()
        elif limits.message_timeout_s is not None:
            due = now - limits.message_timeout_s
            for s in [s for s in self._streams.values() if s.waiting and s.inbox is None and s.since < due]:
                message = f"the request message did not arrive within {limits.message_timeout_s:g} s"
                self._fail(s, grpc.StatusCode.DEADLINE_EXCEEDED, message, reset=True)

    def _stalled(self, now: float, transport: asyncio.Transport) -> bool:
        """Whether output has waited, without moving, for longer than ``stall_timeout_s``: the transport full or a
        stream's answer waiting for a window the client does not open."""
        timeout = self._server.limits.stall_timeout_s
        if timeout is None:
            return False
        waiting = self._writing_paused or any(s.pending for s in self._streams.values())
        progress = (self._budget.data_sent, transport.get_write_buffer_size(), self._send_window)
        if not waiting or progress != self._progress:
            self._progress, self._stalled_since = progress, None
            return False
        if self._stalled_since is None:
            self._stalled_since = now
        return now - self._stalled_since > timeout


__all__ = ["Http2Connection"]
