"""The gateway's own HTTP/1.1 front (``protocols/rest/server.py``) as a stranger meets it: pipelined requests
that mix native and ASGI routes, malformed requests, bodies over the bound, clients that leave mid-body,
slowloris headers, HTTP/1.0, refusals that keep the connection in step, and a replica gone mid-request."""

from __future__ import annotations

import asyncio

from octacloud.gateway.limits import GatewayLimits
from octacloud.protocols.rest.request import Http1Request
from octacloud.protocols.rest.server import Http1Server
from tests.reliability.harness import answers, complete, exchange, gateway, parse, read

INFER = b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b"


async def test_pipelined_native_and_asgi_routes_are_answered_in_order() -> None:
    gw = await gateway(replicas=1, delay_s=0.05)  # the first answer is the slowest: it must still come first
    try:
        wire = (
            INFER % (3, b"abc")
            + b"GET /v2 HTTP/1.1\r\nHost: x\r\n\r\n"
            + b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nde\r\n0\r\n\r\n"
            + b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n"
            + INFER % (1, b"f")
        )
        got = answers(await exchange(gw.port, wire, complete(5)))
        assert [status for status, _ in got] == [200, 200, 200, 404, 200]
        assert got[0][1] == b"cba" and b"octacloud" in got[1][1] and got[2][1] == b"ed" and got[4][1] == b"f"
    finally:
        await gw.close()


async def test_a_malformed_request_line_is_400_and_closed_and_others_are_served() -> None:
    gw = await gateway()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)  # a good keep-alive client
        for wire in (b"GARBAGE\r\n\r\n", b"GET /v2 HTTP/9.9\r\n\r\n", b"GET / HTTP/1.1\r\nBad Header\r\n\r\n"):
            raw = await exchange(gw.port, wire, lambda _: False)  # read until the gateway closes
            assert raw.startswith(b"HTTP/1.1 400 ") and b"connection: close" in raw.lower(), raw
        writer.write(INFER % (2, b"ok"))
        assert answers(await read(reader, complete(1))) == [(200, b"ko")]
        writer.close()
    finally:
        await gw.close()


async def test_a_chunked_body_growing_past_the_bound_is_refused_and_the_connection_closed() -> None:
    gw = await gateway(GatewayLimits(max_body_bytes=1000))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(3):
            writer.write(b"200\r\n" + b"x" * 512 + b"\r\n")
        raw = await read(reader, lambda _: False)  # answered, then closed: the rest of the body is never read
        [(status, headers, body)] = parse(raw)[0]
        assert status == 413 and headers[b"connection"] == b"close" and b"1000 bytes" in body
        assert gw.replicas[0][0].seen == []
        writer.close()
    finally:
        await gw.close()


async def test_a_client_that_leaves_mid_body_costs_nothing_and_the_next_is_served() -> None:
    gw = await gateway()
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nonly-part")
        await asyncio.sleep(0.1)
        writer.close()
        await asyncio.sleep(0.1)
        counters = gw.routes.counter("m")
        assert counters.outstanding == 0 and gw.replicas[0][0].seen == []
        assert answers(await exchange(gw.port, INFER % (2, b"ok"), complete(1))) == [(200, b"ko")]
    finally:
        await gw.close()


async def test_slowloris_headers_are_cut_off_without_harming_another_connection() -> None:
    gw = await gateway(GatewayLimits(header_timeout_s=0.5))
    try:
        slow_reader, slow = await asyncio.open_connection("127.0.0.1", gw.port)
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        closed, served = False, 0
        for byte in b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40:
            slow.write(bytes([byte]))  # one byte at a time: every byte is fresh, the head never ends in time
            writer.write(INFER % (2, b"ok"))  # meanwhile another client is served at once, again and again
            assert answers(await read(reader, complete(1))) == [(200, b"ko")]
            served += 1
            await asyncio.sleep(0.05)
            try:
                got = await asyncio.wait_for(slow_reader.read(1), 0.001)
            except TimeoutError:
                continue
            assert got == b""  # closed by the gateway, not answered
            closed = True
            break
        # cut off before its head could end, while the other client was answered all along
        assert closed and served >= 2, (closed, served)
        slow.close()
        writer.close()
    finally:
        await gw.close()


async def test_a_refusal_with_a_small_body_keeps_the_connection_in_step() -> None:
    gw = await gateway()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(b"POST /v2/models/nope/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
        writer.write(INFER % (2, b"ok"))  # the refused body is dropped; this request is parsed after it
        got = answers(await read(reader, complete(2)))
        assert [s for s, _ in got] == [404, 200] and got[1][1] == b"ko"
        writer.close()
    finally:
        await gw.close()


async def test_http_1_0_is_answered_and_closed() -> None:
    gw = await gateway()
    try:
        raw = await exchange(
            gw.port, b"POST /v2/models/m/infer HTTP/1.0\r\nContent-Length: 3\r\n\r\nabc", lambda _: False
        )
        [(status, headers, body)] = parse(raw)[0]
        assert (status, body) == (200, b"cba") and headers[b"connection"] == b"close" and b"date" in headers
        assert b"server" not in headers
    finally:
        await gw.close()


async def test_a_replica_gone_mid_request_is_502_or_503_never_a_hang() -> None:
    gw = await gateway(replicas=1, delay_s=0.5)
    try:
        task = asyncio.create_task(exchange(gw.port, INFER % (2, b"ok"), complete(1)))
        await asyncio.sleep(0.2)
        [(_, server, _)] = gw.replicas
        server.force_exit = True  # the replica's connections drop with the request in flight
        for conn in list(server.server_state.connections):
            conn.transport.abort()
        [(status, _)] = answers(await task)
        assert status in (502, 503)
    finally:
        await gw.close()


async def test_stop_lets_an_answer_in_progress_finish_and_closes_idle_connections() -> None:
    async def slow(request: Http1Request) -> None:
        await asyncio.sleep(0.2)
        request.respond(200, b"", b"done")

    server = Http1Server(slow)
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    port = await server.start(sock)
    idle_reader, idle = await asyncio.open_connection("127.0.0.1", port)
    task = asyncio.create_task(exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", complete(1)))
    await asyncio.sleep(0.05)
    await server.stop(2)
    assert answers(await task) == [(200, b"done")]
    assert await read(idle_reader, lambda _: False) == b""
    idle.close()


async def test_a_silent_connection_is_on_the_header_clock_an_answered_one_on_the_keep_alive_clock() -> None:
    gw = await gateway(GatewayLimits(header_timeout_s=1.0, keep_alive_s=0.3))
    try:
        silent_reader, silent = await asyncio.open_connection("127.0.0.1", gw.port)
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(INFER % (2, b"ok"))
        assert answers(await read(reader, complete(1))) == [(200, b"ko")]
        order: list[str] = []

        async def closed(name: str, r: asyncio.StreamReader) -> None:
            assert await read(r, lambda _: False) == b""  # closed by the gateway
            order.append(name)

        # the answered one idles out on keep_alive_s (0.3 s), the silent one on header_timeout_s (1 s): in that order
        await asyncio.gather(closed("silent", silent_reader), closed("answered", reader))
        assert order == ["answered", "silent"]
        silent.close()
        writer.close()
    finally:
        await gw.close()


async def test_the_in_flight_bound_holds_for_requests_arriving_in_one_loop_turn() -> None:
    """Six connections write at once to a deployment bound at 2 in flight, their requests parsed in the same loop
    turn: the bound is checked as each one's forwarding takes its slot, so exactly 2 reach the replica."""
    gw = await gateway(GatewayLimits(max_inflight_per_replica=2), delay_s=0.3)
    try:
        conns = [await asyncio.open_connection("127.0.0.1", gw.port) for _ in range(6)]
        for _, writer in conns:
            writer.write(INFER % (2, b"ab"))
        got = [answers(await read(reader, complete(1)))[0][0] for reader, _ in conns]
        assert sorted(got) == [200, 200, 503, 503, 503, 503], got
        assert len(gw.replicas[0][0].seen) == 2 and gw.routes.counters["m"].outstanding == 0
        for _, writer in conns:
            writer.close()
    finally:
        await gw.close()
