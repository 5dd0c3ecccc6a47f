"""The HTTP/2 server with raw methods and an admission hook (what the cloud's gateway runs), its bounds, and
the HTTP/2 client (protocols/grpc/h2_client.py) against it and against grpc.aio: real grpc clients and raw
frames, windows smaller than the messages, refusals before the message is read, deadlines, and servers
that go away."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
import hpack
import pytest

from octacloud.protocols.grpc import h2
from octacloud.protocols.grpc.h2_client import Channel, Unreachable
from octacloud.protocols.server import new_event_loop

PATH = "/t.T/Echo"


def run(coro: Callable[[], Awaitable[None]]) -> None:
    loop = new_event_loop()  # uvloop, as the gateway runs
    try:
        loop.run_until_complete(coro())
    finally:
        loop.close()


class Echo:
    """Raw methods: Echo answers the message reversed; Fail aborts with trailing metadata; Slow sleeps."""

    def __init__(self) -> None:
        self.calls = 0
        self.slow_answered = 0
        self.admitted: list[tuple[str, h2.Metadata]] = []

    def methods(self) -> dict[str, h2.Method]:
        async def echo(message: bytes, context: h2.CallContext) -> bytes:
            self.calls += 1
            assert context.state == "principal"
            context.set_trailing_metadata([("x-seen", str(len(message)))])
            return message[::-1]

        async def fail(message: bytes, context: h2.CallContext) -> bytes:
            self.calls += 1
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such thing: é %", (("retry-after", "3"),))
            raise AssertionError("unreachable")

        async def slow(message: bytes, context: h2.CallContext) -> bytes:
            await asyncio.sleep(float(message or b"0.5"))
            self.slow_answered += 1
            return b"late"

        return {
            PATH: h2.Method(None, echo, streaming=False),
            "/t.T/Fail": h2.Method(None, fail, streaming=False),
            "/t.T/Slow": h2.Method(None, slow, streaming=False),
        }

    def admit(self, path: str, metadata: h2.Metadata) -> Any:
        self.admitted.append((path, metadata))
        if ("authorization", "Bearer good") not in metadata:
            return grpc.StatusCode.UNAUTHENTICATED, "bad key", (("www-authenticate", "Bearer"),)
        return "principal"


@asynccontextmanager
async def serving(**limits: Any) -> AsyncIterator[tuple[Echo, h2.Http2Server, int]]:
    echo = Echo()
    server = h2.Http2Server(echo.methods(), admit=echo.admit, **limits)
    port = await server.start("127.0.0.1", 0)
    try:
        yield echo, server, port
    finally:
        await server.stop(0.5)


GOOD = h2.metadata_block([("authorization", "Bearer good")])


def test_raw_methods_answer_bytes_with_trailing_metadata_through_the_client() -> None:
    async def go() -> None:
        async with serving() as (_, _, port):
            channel = Channel("127.0.0.1", port)
            big = bytes(range(256)) * 1000  # 256 kB: past every default window and frame size
            answers = await asyncio.gather(*(channel.call(PATH, GOOD, big[:n], 5) for n in (0, 1, 100, len(big))))
            assert [a.message for a in answers] == [big[:n][::-1] for n in (0, 1, 100, len(big))]
            assert all(a.code is grpc.StatusCode.OK for a in answers)
            assert answers[-1].trailing == (("x-seen", str(len(big))),)
            assert channel.open_connections == 1  # the calls shared one connection
            failed = await channel.call("/t.T/Fail", GOOD, b"x", 5)
            assert (failed.code, failed.details, failed.trailing) == (
                grpc.StatusCode.NOT_FOUND,
                "no such thing: é %",
                (("retry-after", "3"),),
            )
            unknown = await channel.call("/t.T/Nope", GOOD, b"x", 5)
            assert unknown.code is grpc.StatusCode.UNIMPLEMENTED
            channel.close()

    run(go)


def test_a_message_of_tens_of_megabytes_goes_both_ways_whole() -> None:
    """Thousands of DATA frames each way, within the windows, every byte in place (how long it takes is
    measured by ``bench/big_message.py``, gateway against direct)."""

    async def go() -> None:
        async with serving(max_message_bytes=64 * 2**20) as (_, _, port):
            channel = Channel("127.0.0.1", port)
            big = bytes(range(256)) * (40 * 2**12)  # 40 MiB
            answer = await channel.call(PATH, GOOD, big, 20)
            assert answer.code is grpc.StatusCode.OK, answer.details
            assert answer.message == big[::-1]
            assert answer.trailing == (("x-seen", str(len(big))),)
            channel.close()

    run(go)


def test_a_refused_key_ends_the_call_before_the_message_is_read() -> None:
    async def go() -> None:
        async with (
            serving(max_message_bytes=2**20) as (echo, _, port),
            grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", -1)]) as c,
        ):
            call = c.unary_unary(PATH)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call(b"\0" * 50 * 2**20, metadata=(("authorization", "Bearer bad"),), timeout=10)
            assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED and e.value.details() == "bad key"
            assert ("www-authenticate", "Bearer") in tuple(e.value.trailing_metadata() or ())
            assert echo.calls == 0  # and not RESOURCE_EXHAUSTED: the 50 MiB message was never taken in
            with pytest.raises(grpc.aio.AioRpcError) as e:  # a good key, a message over the limit
                await call(b"\0" * (2**20 + 1), metadata=(("authorization", "Bearer good"),), timeout=10)
            assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert echo.calls == 0
            assert await call(b"ab", metadata=(("authorization", "Bearer good"),), timeout=10) == b"ba"

    run(go)


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream) + payload


def _headers(path: str, key: str = "good") -> bytes:
    return hpack.Encoder().encode(
        [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "x"),
         ("content-type", "application/grpc"), ("te", "trailers"), ("authorization", f"Bearer {key}")]
    )  # fmt: skip


def _frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    out, pos = [], 0
    while len(data) - pos >= 9:
        n = int.from_bytes(data[pos : pos + 3], "big")
        out.append(
            (data[pos + 3], data[pos + 4], int.from_bytes(data[pos + 5 : pos + 9], "big"), data[pos + 9 : pos + 9 + n])
        )
        pos += 9 + n
    return out


async def _raw(port: int, wire: bytes, seconds: float = 2.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(wire)
    got = b""
    try:
        async with asyncio.timeout(seconds):
            while chunk := await reader.read(65536):
                got += chunk
    except TimeoutError:
        pass
    writer.close()
    return got


async def _closed_by_server(port: int, wire: bytes, deadline_s: float = 10.0) -> bytes:
    """What the server sent before it closed the connection; raises TimeoutError if it never closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(wire)
    got = b""
    try:
        async with asyncio.timeout(deadline_s):
            while chunk := await reader.read(65536):
                got += chunk
    finally:
        writer.close()
    return got


def _status(frames: list[tuple[int, int, int, bytes]], stream: int) -> dict[str, str]:
    decoder = hpack.Decoder()
    found: dict[str, str] = {}
    for kind, _, sid, payload in frames:
        if kind == h2.HEADERS:
            headers = dict(decoder.decode(payload))
            if sid == stream:
                found.update(headers)
    return found


def test_the_length_prefix_is_checked_before_the_body_arrives() -> None:
    """Only the 5-byte prefix of a 100 MB message is sent: the refusal comes at once, with RST_STREAM."""

    async def go() -> None:
        async with serving(max_message_bytes=1000) as (echo, _, port):
            prefix = b"\x00" + struct.pack(">I", 100 * 2**20)
            wire = h2.PREFACE + _frame(h2.SETTINGS, 0, 0) + _frame(h2.HEADERS, h2.END_HEADERS, 1, _headers(PATH))
            frames = _frames(await _raw(port, wire + _frame(h2.DATA, 0, 1, prefix), 1.0))
            assert _status(frames, 1)["grpc-status"] == str(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
            assert any(kind == h2.RST_STREAM and sid == 1 for kind, _, sid, _ in frames)
            assert echo.calls == 0

    run(go)


def test_streams_calls_and_connections_are_bounded() -> None:
    async def go() -> None:
        async with serving(max_streams=2, max_calls=1, max_connections=2) as (_, server, port):
            # a third stream open at once on one connection: REFUSED_STREAM (the others are served)
            wire = h2.PREFACE + _frame(h2.SETTINGS, 0, 0)
            for sid in (1, 3, 5):
                wire += _frame(h2.HEADERS, h2.END_HEADERS, sid, _headers("/t.T/Slow"))
            frames = _frames(await _raw(port, wire, 1.0))
            assert [(sid, payload) for kind, _, sid, payload in frames if kind == h2.RST_STREAM] == [
                (5, struct.pack(">I", h2.REFUSED_STREAM))
            ]
            # one call in progress at most: the second is RESOURCE_EXHAUSTED, the first is served
            channel = Channel("127.0.0.1", port)
            slow = asyncio.ensure_future(channel.call("/t.T/Slow", GOOD, b"0.3", 5))
            await asyncio.sleep(0.1)
            second = await channel.call(PATH, GOOD, b"x", 5)
            assert second.code is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (await slow).message == b"late"
            assert server.calls == 0
            # connections past the bound are closed on arrival
            socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
            await asyncio.sleep(0.2)
            assert server.refused >= 1
            for s in socks:
                s.close()
            channel.close()

    run(go)


def test_silent_and_idle_connections_are_closed() -> None:
    async def go() -> None:
        async with serving(header_timeout_s=0.3, idle_timeout_s=0.6) as (_, _, port):
            await _closed_by_server(port, b"")  # a client that never sends its preface: closed by the server
            channel = Channel("127.0.0.1", port)
            assert (await channel.call(PATH, GOOD, b"ab", 5)).message == b"ba"
            assert channel.open_connections == 1
            await asyncio.sleep(2.0)  # idle past 0.6 s: GOAWAY and closed
            assert channel.open_connections == 0
            assert (await channel.call(PATH, GOOD, b"cd", 5)).message == b"dc"  # a new connection
            channel.close()

    run(go)


def test_the_client_honours_small_windows_and_deadlines_against_grpc_aio() -> None:
    """grpc.aio's server starts with 64 KiB windows: a 1 MB call must wait for its WINDOW_UPDATEs."""

    async def go() -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", -1)])

        async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            context.set_trailing_metadata((("x-n", str(len(request))),))
            if request == b"sleep":
                await asyncio.sleep(2)
            return request[::-1]

        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("t.T", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            channel = Channel("127.0.0.1", port)
            big = bytes(range(251)) * 4000
            answers = await asyncio.gather(*(channel.call(PATH, b"", big, 10) for _ in range(3)))
            assert all(a.code is grpc.StatusCode.OK and a.message == big[::-1] for a in answers)
            assert answers[0].trailing == (("x-n", str(len(big))),)
            with pytest.raises(TimeoutError):
                await channel.call(PATH, b"", b"sleep", 0.3)
            assert (await channel.call(PATH, b"", b"after", 5)).message == b"retfa"  # the connection still serves
            channel.close()
        finally:
            await server.stop(0)

    run(go)


def test_a_server_that_is_gone_or_going_away_is_unreachable() -> None:
    async def go() -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free = s.getsockname()[1]
        with pytest.raises(Unreachable):
            await Channel("127.0.0.1", free, connect_timeout=1).call(PATH, GOOD, b"x", 1)
        echo = Echo()
        server = h2.Http2Server(echo.methods(), admit=echo.admit)
        port = await server.start("127.0.0.1", 0)
        channel = Channel("127.0.0.1", port)
        slow = asyncio.ensure_future(channel.call("/t.T/Slow", GOOD, b"0.3", 5))
        await asyncio.sleep(0.1)
        await server.stop(2)  # GOAWAY: the call in flight finishes, then the connection closes
        assert (await slow).message == b"late"
        with pytest.raises(Unreachable):
            await channel.call(PATH, GOOD, b"x", 1)
        channel.close()

    run(go)


def test_a_client_that_breaks_the_protocol_gets_goaway() -> None:
    async def go() -> None:
        async with serving() as (_, _, port):
            frames = _frames(
                await _raw(
                    port, h2.PREFACE + _frame(h2.SETTINGS, 0, 0) + _frame(h2.HEADERS, h2.END_HEADERS, 2, _headers(PATH))
                )
            )
            assert any(kind == h2.GOAWAY for kind, _, _, _ in frames)
            channel = Channel("127.0.0.1", port)
            assert (await channel.call(PATH, GOOD, b"ok", 5)).message == b"ko"  # still serving
            channel.close()

    run(go)


def test_a_server_that_dies_mid_call_or_answers_garbage() -> None:
    """A server killed after taking the call (the connection drops): Unreachable; one that answers bytes that
    are not HTTP/2: INTERNAL, and the next call opens a new connection."""

    async def go() -> None:
        async def dies(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readexactly(100)  # past the preface and settings: the call's frames
            writer.transport.abort()  # as a kill -9 would: no GOAWAY, no answer

        async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readexactly(100)
            writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n" + b"\xff" * 64)
            writer.close()

        for handler, expect in ((dies, Unreachable), (garbage, None)):
            server = await asyncio.start_server(handler, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            channel = Channel("127.0.0.1", port)
            if expect is not None:
                with pytest.raises(expect):
                    await channel.call(PATH, GOOD, b"x", 5)
            else:
                answer = await channel.call(PATH, GOOD, b"x", 5)
                assert answer.code is grpc.StatusCode.INTERNAL and "broke HTTP/2" in answer.details
            await asyncio.sleep(0.1)
            assert channel.open_connections == 0
            channel.close()
            server.close()
            await server.wait_closed()

    run(go)


def test_kept_header_blocks_decode_as_a_fresh_decoder_would() -> None:
    """Blocks from an indexing encoder (as grpc clients send them): repeated sets, new values, evictions from
    a small table, a table size update; every block decodes exactly as a decoder without the cache does."""
    import random

    rng = random.Random(7)
    encoder, reference = hpack.Encoder(), hpack.Decoder()
    conn = h2.Http2Connection(h2.Http2Server({}))
    keys = [f"Bearer {'k' * 40}{i}" for i in range(4)]
    for step in range(600):
        if step == 300:
            assert conn._decoded  # with every set indexed, blocks repeat and are kept
            encoder.header_table_size = 256  # evictions from here on, and a size update in the next block
        headers = [(":method", "POST"), (":path", rng.choice(["/a/B", "/a/C"])), ("te", "trailers"),
                   ("authorization", rng.choice(keys)), ("x-n", str(rng.randrange(3)))]  # fmt: skip
        block = encoder.encode(headers)
        want = reference.decode(block)
        assert conn._decode(block) == want == headers, step


def test_each_call_gets_its_own_path_and_metadata_when_header_blocks_repeat() -> None:
    """A grpc.aio client indexes its headers, so its calls repeat header blocks, which the server reads once
    while they are kept: every call must still be admitted with exactly the path and metadata it sent,
    through new values, repeats and a key that changes between calls."""

    async def go() -> None:
        async with serving() as (echo, _, port):
            sent: list[tuple[str, tuple[tuple[str, str], ...]]] = []
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                for i in range(40):
                    path = PATH if i % 3 else "/t.T/Fail"
                    key = "Bearer good" if i % 5 else "Bearer bad"
                    metadata = (("authorization", key), ("x-n", str(i % 4)))
                    call = channel.unary_unary(path)
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await call(b"m", metadata=metadata, timeout=5)
                    sent.append((path, metadata))
            admitted = [
                (path, tuple((k, v) for k, v in md if k in ("authorization", "x-n"))) for path, md in echo.admitted
            ]
            assert admitted == sent

    run(go)


def test_the_gate_refuses_in_the_frame_handling_and_release_follows_every_admitted_call() -> None:
    """A gate sees the whole message before any task: its refusal is one trailers-only HEADERS frame and the
    method is never called; what it returns is the call's state, handed to ``release`` once the call is done,
    however it ended (answered, aborted, or its client gone mid-call)."""

    async def go() -> None:
        echo = Echo()
        released: list[Any] = []

        def gate(path: str, state: Any, message: bytes) -> Any:
            if message == b"no":
                return grpc.StatusCode.UNAVAILABLE, "full", (("retry-after", "1"),)
            return state

        server = h2.Http2Server(echo.methods(), admit=echo.admit, gate=gate, release=released.append)
        port = await server.start("127.0.0.1", 0)
        try:
            channel = Channel("127.0.0.1", port)
            answer = await channel.call(PATH, GOOD, b"no", 5)
            assert (answer.code, answer.details) == (grpc.StatusCode.UNAVAILABLE, "full")
            assert ("retry-after", "1") in answer.trailing and echo.calls == 0 and released == []
            assert (await channel.call(PATH, GOOD, b"ab", 5)).message == b"ba"
            assert (await channel.call("/t.T/Fail", GOOD, b"", 5)).code is grpc.StatusCode.NOT_FOUND
            channel.close()
            for _ in range(50):
                if len(released) == 2:
                    break
                await asyncio.sleep(0.01)
            assert released == ["principal", "principal"]
            wire = h2.PREFACE + _frame(h2.SETTINGS, 0, 0) + _frame(h2.HEADERS, h2.END_HEADERS, 1, _headers(PATH))
            frames = _frames(await _raw(port, wire + _frame(h2.DATA, h2.END_STREAM, 1, b"\x00\x00\x00\x00\x02no"), 0.5))
            assert [f for f in frames if f[2] == 1 and f[0] != h2.HEADERS] == []  # trailers-only, no DATA
            assert _status(frames, 1)["grpc-status"] == "14" and _status(frames, 1)["retry-after"] == "1"
            body = b"\x00\x00\x00\x00\x030.5"  # Slow, its client gone before the answer
            slow = h2.PREFACE + _frame(h2.SETTINGS, 0, 0) + _frame(h2.HEADERS, h2.END_HEADERS, 1, _headers("/t.T/Slow"))
            await _raw(port, slow + _frame(h2.DATA, h2.END_STREAM, 1, body), 0.1)
            for _ in range(100):
                if len(released) == 3:
                    break
                await asyncio.sleep(0.01)
            assert released == ["principal"] * 3 and echo.calls == 2
        finally:
            await server.stop(0.5)

    run(go)


def test_calls_started_together_are_each_sent_at_once_in_their_own_write() -> None:
    """The gateway forwards a burst of calls: each leaves as soon as it is forwarded, HEADERS and DATA in one
    write, not all of them in one write at the end of the loop turn (which would hand the replica the whole
    burst at once and merge its batches; docs/gateway.md)."""

    async def go() -> None:
        async with serving() as (_, _, port):
            channel = Channel("127.0.0.1", port)
            assert (await channel.call(PATH, GOOD, b"warm", 5)).message == b"mraw"  # the connection is up
            (conn,) = channel._connections
            writes: list[bytes] = []
            real = conn._out._transport

            class Recorder:
                def write(self, data: bytes) -> None:
                    writes.append(bytes(data))
                    transport = real()
                    assert transport is not None
                    transport.write(data)

            recorder = Recorder()
            conn._out._transport = lambda: recorder  # type: ignore[assignment,return-value]
            answers = await asyncio.gather(*(channel.call(PATH, GOOD, b"call %d" % i, 5) for i in range(3)))
            assert [a.message for a in answers] == [(b"call %d" % i)[::-1] for i in range(3)]
            calls = [w for w in writes if any(kind == h2.HEADERS for kind, _ in frames(w))]
            assert len(calls) == 3, [frames(w) for w in writes]
            for w in calls:  # one call each: its HEADERS and its one DATA frame, on one stream
                kinds = frames(w)
                assert [k for k, _ in kinds] == [h2.HEADERS, h2.DATA] and kinds[0][1] == kinds[1][1], kinds
            channel.close()

    run(go)


def frames(data: bytes) -> list[tuple[int, int]]:
    """(type, stream) of each HTTP/2 frame in ``data``."""
    out, offset = [], 0
    while offset + 9 <= len(data):
        length = int.from_bytes(data[offset : offset + 3], "big")
        out.append((data[offset + 3], int.from_bytes(data[offset + 5 : offset + 9], "big") & 0x7FFFFFFF))
        offset += 9 + length
    return out


def test_turn_output_write_now_keeps_the_order_of_what_was_queued_and_schedules_nothing() -> None:
    """``write_now`` sends at once, after what the turn already queued (frames keep their order); with nothing
    queued it leaves no end-of-turn flush behind; once the connection is gone it sends nothing."""

    async def go() -> None:
        writes: list[bytes] = []
        flushes = 0

        class Transport:
            def write(self, data: bytes) -> None:
                writes.append(bytes(data))

        class Counted(h2.TurnOutput):
            def flush(self) -> None:
                nonlocal flushes
                flushes += 1
                super().flush()

        transport: Transport | None = Transport()
        out = Counted(lambda: transport)  # type: ignore[arg-type,return-value]
        out.write_now(b"alone")
        assert writes == [b"alone"]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert flushes == 0  # nothing was scheduled
        out.write(b"queued ")
        assert writes == [b"alone"]
        out.write_now(b"then this")
        assert writes == [b"alone", b"queued then this"]
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # the end-of-turn flush the write scheduled finds nothing left
        assert writes == [b"alone", b"queued then this"] and flushes == 2
        transport = None
        out.write_now(b"gone")
        assert writes == [b"alone", b"queued then this"]

    run(go)


async def closed(channel: Channel) -> bool:
    """Whether ``channel`` has no open connection left within a second."""
    for _ in range(100):
        if not channel.open_connections:
            return True
        await asyncio.sleep(0.01)
    return False


def test_a_drained_channel_finishes_its_calls_in_flight_then_closes() -> None:
    """``drain`` (a replica stopped on purpose): the call in flight is answered, no new call is taken, and the
    connection closes once it is done; ``close`` (a replica found dead) ends a call in flight at once."""

    async def go() -> None:
        async with serving() as (echo, _, port):
            channel = Channel("127.0.0.1", port)
            slow = asyncio.ensure_future(channel.call("/t.T/Slow", GOOD, b"0.5", 5))
            await asyncio.sleep(0.1)
            assert channel.open_connections == 1
            channel.drain()
            assert channel.open_connections == 1  # still answering
            with pytest.raises(Unreachable):
                await channel.call(PATH, GOOD, b"ab", 5)  # no new call
            assert (await slow).message == b"late"
            assert await closed(channel)

            other = Channel("127.0.0.1", port)
            cut = asyncio.ensure_future(other.call("/t.T/Slow", GOOD, b"5", 10))
            await asyncio.sleep(0.1)
            other.drain()
            other.close()
            with pytest.raises(Unreachable):
                await cut
            assert echo.slow_answered == 1  # ended before the server's answer to it (5 s away), not by it

            # Drained while its first connection is being made: the call that waited for it is answered there,
            # and the connection closes after it instead of staying open with no channel to close it.
            late = Channel("127.0.0.1", port)
            waiting = asyncio.ensure_future(late.call("/t.T/Slow", GOOD, b"0.2", 5))
            await asyncio.sleep(0)  # the call is connecting
            late.drain()
            assert (await waiting).message == b"late"
            assert await closed(late)

    run(go)
