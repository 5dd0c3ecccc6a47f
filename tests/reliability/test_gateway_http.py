"""The gateway's HTTP duties, byte by byte, in front of fake replicas: 100-continue answered by the gateway and
never forwarded, HEAD, pipelining, the internal secret, bounds on headers, bodies, connections and load."""

from __future__ import annotations

import asyncio

import httpx

from octacloud.control.deployments import Replica
from octacloud.control.probes import HttpProber
from octacloud.gateway.limits import GatewayLimits
from octacloud.gateway.routing import Endpoint, OutlierPolicy, RouteTable
from tests.reliability.harness import SECRET, answers, complete, exchange, gateway, parse, read, serve, stop

INFER = b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\n"


async def test_100_continue_is_answered_by_the_gateway_and_every_answer_reaches_its_own_client() -> None:
    gw = await gateway()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(
            b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n"
        )
        interim = await read(reader, lambda d: b"\r\n\r\n" in d)
        assert interim.startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        writer.write(b"hello")
        final = await read(reader, complete(1))
        assert answers(final) == [(200, b"olleh")]
        for word in (b"second", b"third"):  # the same connection stays in step
            writer.write(
                b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(word), word)
            )
            assert answers(await read(reader, complete(1))) == [(200, word[::-1])]
        writer.close()
        # other clients, on the gateway's pooled connection to the replica, get their own answers
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}") as client:
            for i in range(5):
                r = await client.post("/v2/models/m/infer", content=f"c{i}".encode())
                assert r.content == f"c{i}".encode()[::-1]
        [fake, _, _] = gw.replicas[0]
        assert all(b"expect" not in dict(s["headers"]) for s in fake.seen)
    finally:
        await gw.close()


async def test_head_through_the_gateway_answers_at_once() -> None:
    gw = await gateway()
    try:
        raw = await exchange(  # within the read's deadline: the gateway waits for no body
            gw.port, b"HEAD /v2/models/m/ready HTTP/1.1\r\nHost: x\r\n\r\n", lambda d: b"\r\n\r\n" in d
        )
        assert raw.startswith(b"HTTP/1.1 200")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}") as client:
            assert (await client.head("/v2/models/m/ready")).status_code == 200
            assert (await client.get("/v2/models/m/ready")).json() == {"ready": True}  # the next answer is its own
    finally:
        await gw.close()


async def test_pipelined_requests_are_answered_in_order() -> None:
    gw = await gateway()
    try:
        wire = b"".join(
            b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n%02d" % i for i in range(6)
        )
        raw = await exchange(gw.port, wire, complete(6))
        assert answers(raw) == [(200, (b"%02d" % i)[::-1]) for i in range(6)]
    finally:
        await gw.close()


async def test_chunked_request_body_is_forwarded_whole() -> None:
    gw = await gateway()
    try:
        wire = (
            b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
        )
        assert answers(await exchange(gw.port, wire, complete(1))) == [(200, b"edcba")]
    finally:
        await gw.close()


async def test_the_internal_secret_is_added_and_client_copies_and_keys_are_stripped() -> None:
    gw = await gateway()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}") as client:
            headers = {"x-octacloud-internal": "forged", "authorization": "Bearer k", "x-request-id": "42"}
            await client.post("/v2/models/m/infer", content=b"x", headers=headers)
        [fake, _, _] = gw.replicas[0]
        seen = fake.seen[-1]["headers"]
        assert [v for k, v in seen if k == b"x-octacloud-internal"] == [SECRET.encode()]
        assert all(k != b"authorization" for k, _ in seen)
        assert (b"x-request-id", b"42") in seen
    finally:
        await gw.close()


async def test_a_body_over_the_limit_is_refused_from_its_content_length_without_reading_it() -> None:
    gw = await gateway(GatewayLimits(max_body_bytes=1000))
    try:
        head = (
            b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5000000000\r\n\r\n"
        )
        raw = await exchange(gw.port, head, complete(1))  # no body sent: the answer comes from the headers
        [(status, headers, body)] = parse(raw)[0]
        assert status == 413 and b"over the limit of 1000 bytes" in body
        assert headers.get(b"connection") == b"close"
        assert gw.replicas[0][0].seen == []
    finally:
        await gw.close()


async def test_slow_headers_and_slow_bodies_are_cut_off() -> None:
    gw = await gateway(GatewayLimits(header_timeout_s=0.3, body_timeout_s=0.3))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\n")  # never finishes its headers
        assert await read(reader, lambda _: False, timeout=10) == b""  # closed by the gateway, not by our deadline
        writer.close()
        raw = await exchange(
            gw.port, b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nonly-part", complete(1)
        )
        assert answers(raw)[0][0] == 408
    finally:
        await gw.close()


async def test_connections_over_the_cap_are_closed_and_the_gateway_keeps_serving() -> None:
    gw = await gateway(GatewayLimits(max_connections=20, header_timeout_s=30))
    try:
        idle = [await asyncio.open_connection("127.0.0.1", gw.port) for _ in range(20)]
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        assert await read(reader, lambda _: False, timeout=5) == b""  # the 21st is closed at once
        writer.close()
        for _, w in idle:
            w.close()
        await asyncio.sleep(0.1)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}") as client:
            assert (await client.post("/v2/models/m/infer", content=b"ok")).content == b"ko"
    finally:
        await gw.close()


async def test_a_deployment_over_its_bound_is_shed_fast_with_retry_after() -> None:
    gw = await gateway(GatewayLimits(max_inflight_per_replica=2), delay_s=0.3)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}", timeout=10) as client:
            answered: list[int] = []  # statuses in the order the answers came back

            async def one() -> tuple[int, str | None]:
                r = await client.post("/v2/models/m/infer", content=b"x")
                answered.append(r.status_code)
                return r.status_code, r.headers.get("retry-after")

            results = await asyncio.gather(*(one() for _ in range(8)))
        admitted = [r for r in results if r[0] == 200]
        shed = [r for r in results if r[0] == 503]
        assert len(admitted) == 2 and len(shed) == 6
        assert all(s[1] == "1" for s in shed)
        assert answered == [503] * 6 + [200] * 2  # every refusal came back before the replica's first answer
        assert gw.routes.counters["m"].shed == 6
        assert gw.routes.traffic[("admin", "m")].requests == 2  # refused requests are not billed
    finally:
        await gw.close()


async def test_start_up_is_503_not_404_and_unknown_stays_404() -> None:
    starting = True
    gw = await gateway(ready=lambda: not starting)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}") as client:
            r = await client.post("/v2/models/m/infer", content=b"x")
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            starting = False
            gw.routes.owners["later"] = gw.routes.owners["m"]  # deployed, no replica ready yet
            assert (await client.post("/v2/models/later/infer", content=b"x")).status_code == 503
            assert (await client.post("/v2/models/nope/infer", content=b"x")).status_code == 404
            assert all(t.requests == 0 for t in gw.routes.traffic.values())
    finally:
        await gw.close()


async def test_a_replica_that_went_away_is_ejected_then_taken_back_without_the_controller() -> None:
    gw = await gateway(outlier=OutlierPolicy(base_ejection_s=0.3, max_ejection_s=0.3))
    fake, server, port = gw.replicas[0]
    try:
        server.should_exit = True
        await server.task  # type: ignore[attr-defined]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}") as client:
            for _ in range(3):
                r = await client.post("/v2/models/m/infer", content=b"x")
                assert r.status_code == 503
                assert "127.0.0.1" not in r.text and str(port) not in r.text  # no internal address in answers
            assert gw.routes.healthy("m") == []
            back, _ = await serve(fake, port=port)  # the replica answers again, on the same port
            gw.replicas[0] = (fake, back, port)
            await asyncio.sleep(0.35)
            assert (await client.post("/v2/models/m/infer", content=b"back")).content == b"kcab"
            assert gw.routes.routes["m"][0].failures == 0
    finally:
        await gw.close()


def test_limits_from_the_command_line_and_bad_ones_refused() -> None:
    import pytest

    from octacloud.core.errors import InvalidSpecError
    from octacloud.gateway.grpc_proxy import GrpcGateway
    from octacloud.gateway.rest import RestGateway

    limits = GatewayLimits.parse(["max_inflight_per_replica=32", "header-timeout-s=2.5", "upstream_timeout_s=300"])
    assert (limits.max_inflight_per_replica, limits.header_timeout_s) == (32, 2.5)
    # both fronts wait that long for a replica's answer
    assert RestGateway(RouteTable(), limits=limits).request_timeout == 300
    assert GrpcGateway(RouteTable(), limits=limits).timeout == 300
    assert RestGateway(RouteTable()).request_timeout == GrpcGateway(RouteTable()).timeout == 60
    for bad, why in (
        (["nope=1"], "NAME=VALUE"),
        (["max_connections=x"], "needs a number"),
        (["keep_alive_s=0"], "positive"),
        (["upstream_timeout_s=-1"], "upstream_timeout_s must be a positive number"),
    ):
        with pytest.raises(InvalidSpecError, match=why):
            GatewayLimits.parse(bad)


async def test_admin_bodies_are_bounded_before_they_are_read() -> None:
    from octacloud.gateway.rest import ADMIN_MAX_BODY_BYTES

    gw = await gateway()
    reached: list[str] = []

    async def admin(scope: dict, receive, send) -> None:  # type: ignore[no-untyped-def,type-arg]
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"{}"})

    gw.app.admin = admin
    try:
        big = INFER.replace(b"/v2/models/m/infer", b"/admin/tenants") + b"Content-Length: %d\r\n\r\n" % (
            ADMIN_MAX_BODY_BYTES + 1
        )
        assert answers(await exchange(gw.port, big, complete(1)))[0][0] == 413
        chunked = INFER.replace(b"/v2/models/m/infer", b"/admin/tenants") + b"Transfer-Encoding: chunked\r\n\r\n"
        assert answers(await exchange(gw.port, chunked, complete(1)))[0][0] == 411
        assert reached == []
        ok = INFER.replace(b"/v2/models/m/infer", b"/admin/tenants") + b"Content-Length: 2\r\n\r\n{}"
        assert answers(await exchange(gw.port, ok, complete(1)))[0][0] == 200
    finally:
        await gw.close()


async def test_headers_are_bounded_in_size_and_a_large_body_is_not_mistaken_for_them() -> None:
    gw = await gateway(GatewayLimits(max_header_bytes=8 * 1024))
    try:
        huge = INFER + b"X-Filler: " + b"a" * 20_000 + b"\r\nContent-Length: 1\r\n\r\nx"
        raw = await exchange(gw.port, huge, complete(1))
        assert answers(raw)[0][0] == 431
        body = b"b" * 200_000  # headers and a big body in one write: only the headers count
        raw = await exchange(gw.port, INFER + b"Content-Length: %d\r\n\r\n" % len(body) + body, complete(1))
        assert answers(raw) == [(200, body[::-1])]
        assert gw.replicas[0][0].seen[-1]["body"] == body
    finally:
        await gw.close()


async def test_a_replica_address_taken_by_another_replica_is_retried_not_answered_from() -> None:
    """A replica dies and another (another deployment's, another tenant's) starts on its port before the route is
    dropped: the newcomer refuses what was meant for the dead one (421) and the gateway tries the next replica,
    so no answer comes from a replica the request was not sent to."""
    gw = await gateway(replicas=2, identify=True, outlier=OutlierPolicy(base_ejection_s=30, max_ejection_s=30))
    _, _, port_r1 = gw.replicas[1]
    fake_r0, server_r0, _ = gw.replicas[0]
    try:
        await stop(server_r0)  # r0 is gone; r1 now listens where r0's route points
        gw.routes.update("m", [Endpoint("r0", "127.0.0.1", port_r1, 0), Endpoint("r1", "127.0.0.1", port_r1, 0)])
        gw.replicas = gw.replicas[1:]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}") as client:
            calls = 0  # the choice between r0 and r1 is random: call until r0 has failed often enough to be ejected
            while calls < 100 and len(gw.routes.healthy("m")) == 2:
                r = await client.post(
                    "/v2/models/m/infer", content=b"ab%d" % calls, headers={"x-octacloud-replica": "r0"}
                )
                assert (r.status_code, r.content) == (200, (b"ab%d" % calls)[::-1])
                calls += 1
            fake_r1 = gw.replicas[0][0]
            named = [v for seen in fake_r1.seen for k, v in seen["headers"] if k == b"x-octacloud-replica"]
            assert named == [b"r1"] * calls  # a client's copy of the header is not forwarded
            assert fake_r0.seen == []
            assert [e.replica_id for e in gw.routes.healthy("m")] == ["r1"]  # the stale route is ejected
            gw.routes.update("m", [Endpoint("r0", "127.0.0.1", port_r1, 0)])  # only the stale route is left
            r = await client.post("/v2/models/m/infer", content=b"x")
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
            assert str(port_r1) not in r.text and "127.0.0.1" not in r.text
    finally:
        await gw.close()


async def test_the_prober_does_not_take_another_replica_at_a_dead_ones_address_for_it() -> None:
    """The controller's readiness probe names the replica it means: a newcomer on a dead replica's port answers
    421, so the dead replica is not kept READY (and routed to) on the strength of someone else's answer."""
    gw = await gateway(replicas=1, identify=True)
    _, _, port = gw.replicas[0]
    prober = HttpProber(headers=[(b"x-octacloud-internal", SECRET.encode())])
    try:
        alive = Replica("r0", "m", host="127.0.0.1", http_port=port)
        stale = Replica("gone", "m", host="127.0.0.1", http_port=port)
        assert (await prober.probe(alive, "m", 2.0)).ready
        probe = await prober.probe(stale, "m", 2.0)
        assert not probe.ready and not probe.failed
    finally:
        await prober.pool.close()
        await gw.close()
