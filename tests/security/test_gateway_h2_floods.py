"""The published HTTP/2 attack classes, sent raw to a real cloud's gRPC front while another tenant's REST and gRPC
traffic is measured alongside: CONTINUATION floods, partial messages held open, a client that never reads,
rapid reset, and floods of SETTINGS, PING, WINDOW_UPDATE, PRIORITY and empty frames (issue 33 items 4 to 6); and
calls without a key held open over many connections, each on its own connection's budget.

Each attack is cut where ``protocols.grpc.h2_limits`` says; the victim's calls all succeed, and the gateway's
resident memory (this process: the cloud runs in a thread here) grows by less than :data:`RSS_BOUND` while the
attack holds its connections open. The cloud runs with small bounds (2 MiB messages, 3 MiB of unfinished calls
a connection, 6 MiB a tenant, 3 s for a body or a header block) so that each attack is a few MiB past them.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace

import hpack
import pytest

from tests import h2wire
from tests.cluster.conftest import write_linear_model
from tests.cluster.test_cloud_e2e import config, wait_until
from tests.security.test_gateway_h2_headers import INFER, Setup, VictimTraffic, infer_message, victim_and_attacker

pytestmark = pytest.mark.slow

MIB = 2**20
RSS_BOUND = 32 * MIB
"""The most the gateway's resident memory may grow while one attack holds its connections open."""
PER_CONNECTION, PER_TENANT, WAITING = 3 * MIB, 6 * MIB, 64
ENHANCE_YOUR_CALM, PROTOCOL_ERROR, FLOW_CONTROL_ERROR = 11, 1, 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("h2-floods")
    write_linear_model(root / "models")
    cfg = config(root, root / "models")
    cfg.limits = replace(
        cfg.limits,
        max_inflight_per_replica=64,
        max_message_bytes=2 * MIB,
        grpc_unfinished_bytes_per_connection=PER_CONNECTION,
        grpc_unfinished_bytes_per_tenant=PER_TENANT,
        grpc_unfinished_calls_per_tenant=WAITING,
        body_timeout_s=3.0,
        header_timeout_s=3.0,
    )
    with victim_and_attacker(cfg) as s:
        yield s


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def under_attack(setup: Setup, attack: Callable[[int], Awaitable[None]]) -> tuple[VictimTraffic, int]:
    """Run ``attack(grpc_port)`` while the victim calls; returns the victim's traffic and how much the gateway's
    RSS grew from before the attack to its end (the attack's connections still open)."""
    with VictimTraffic(setup) as victim:
        wait_until("the victim's first calls", lambda: victim.ok >= 4)
        before = rss()
        grown = asyncio.run(_attacked(attack, setup.grpc_port, before))
    return victim, grown


async def _attacked(attack: Callable[[int], Awaitable[None]], port: int, before: int) -> int:
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, rss() - before)
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    try:
        await attack(port)
    finally:
        watcher.cancel()
    return max(peak, rss() - before)


def assert_unharmed(victim: VictimTraffic, grown: int) -> None:
    assert victim.failed == [], victim.failed[:5]
    assert victim.ok >= 40
    assert grown < RSS_BOUND, f"the gateway's RSS grew by {grown / MIB:.0f} MiB"


@asynccontextmanager
async def opened(setup: Setup) -> AsyncIterator[h2wire.H2Wire]:
    """A raw connection to the gateway's gRPC front, closed however the attack ends."""
    wire = await h2wire.H2Wire.open(setup.grpc_port)
    try:
        yield wire
    finally:
        wire.close()


async def send_until_cut(wire: h2wire.H2Wire, chunks: Iterator[bytes]) -> int:
    """Send ``chunks`` until they run out, the server closes, or it stops reading for 3 s; returns bytes sent."""
    sent = 0
    for chunk in chunks:
        try:
            wire.writer.write(chunk)
            await asyncio.wait_for(wire.writer.drain(), 3)
        except (ConnectionError, TimeoutError):
            break
        sent += len(chunk)
    return sent


async def closed_by_server(wire: h2wire.H2Wire, silence_s: float = 10.0) -> bool:
    """Read what the server sends until it closes the connection (True) or is silent for ``silence_s`` (False)."""
    while True:
        try:
            chunk = await asyncio.wait_for(wire.reader.read(2**20), silence_s)
        except ConnectionError:
            return True
        except TimeoutError:
            return False
        if not chunk:
            return True
        wire.received += chunk


def goaway_of(wire: h2wire.H2Wire) -> tuple[int, bytes] | None:
    return h2wire.goaway(h2wire.parse(wire.received))


def test_a_continuation_flood_is_cut_at_the_header_limit_without_a_key(setup: Setup) -> None:
    """Issue 33 item 4: HEADERS without END_HEADERS, then 16 KiB CONTINUATION frames (64 MiB on each of two
    connections), then a flood of empty-ish CONTINUATION frames, and a block never ended. The first two get
    GOAWAY ENHANCE_YOUR_CALM once the block passes the 64 KiB header limit, the third once it passes the frames
    that limit needs, the last is closed after ``header_timeout_s``."""
    limit = setup.cloud.cloud.config.limits.max_header_bytes
    outcomes: dict[str, object] = {}

    async def flood(name: str, size: int, total: int) -> None:
        async with opened(setup) as wire:
            closed = asyncio.create_task(closed_by_server(wire))  # reading all along: the GOAWAY is read as it comes
            start = h2wire.frame(h2wire.HEADERS, 0, 1, h2wire.grpc_headers(INFER))
            piece = h2wire.frame(h2wire.CONTINUATION, 0, 1, b"\x40" * size)
            chunks = [start, *([piece * max(1, 2**16 // (size + 9))] * (total // 2**16))]
            sent = await send_until_cut(wire, iter(chunks))
            outcomes[name] = (sent, await closed, goaway_of(wire))

    async def never_ended() -> None:
        async with opened(setup) as wire:
            await wire.send(h2wire.frame(h2wire.HEADERS, 0, 1, h2wire.grpc_headers(INFER)))
            outcomes["never ended"] = (0, await closed_by_server(wire), goaway_of(wire))

    async def attack(port: int) -> None:
        await asyncio.gather(flood("big 1", 16384, 64 * MIB), flood("big 2", 16384, 64 * MIB),
                             flood("small", 1, 4 * MIB), never_ended())  # fmt: skip

    victim, grown = under_attack(setup, attack)
    assert_unharmed(victim, grown)
    for name in ("big 1", "big 2"):
        sent, closed, away = outcomes[name]  # type: ignore[misc]
        assert closed and away is not None, outcomes
        assert away[0] == ENHANCE_YOUR_CALM and f"a header block over {limit} bytes".encode() in away[1], away
        assert sent < 64 * MIB  # cut: the client could not send it all
    _, closed, away = outcomes["small"]  # type: ignore[misc]
    assert closed and away is not None and away[0] == ENHANCE_YOUR_CALM and b"frames" in away[1], away
    _, closed, away = outcomes["never ended"]  # type: ignore[misc]
    assert closed and away is not None and b"not ended within 3 s" in away[1], away


def test_partial_messages_are_bounded_per_connection_and_per_tenant_and_timed_out(setup: Setup) -> None:
    """Issue 33 item 5: one tenant opens four connections of eight calls, each announcing a 1.9 MiB message,
    sending 1.5 MiB of it and never ending it (48 MiB in all), and a fifth connection of HEADERS-only calls past
    the tenant's bound on waiting calls. What the tenant holds never passes its 6 MiB; each call past a bound is
    RESOURCE_EXHAUSTED on its stream, and every other ends DEADLINE_EXCEEDED once ``body_timeout_s`` has
    passed, its memory given back."""
    key = ("authorization", f"Bearer {setup.attacker}")
    inputs = setup.cloud.cloud._fronts.grpc.server.inputs  # type: ignore[attr-defined]
    answers: list[dict[str, str]] = []
    held: list[int] = []

    def partial(sid: int) -> bytes:
        out = h2wire.header_frames(sid, h2wire.grpc_headers(INFER, [key]))
        wire = b"\x00" + struct.pack(">I", 1900 * 1024) + b"\x00" * (1536 * 1024)
        for i in range(0, len(wire), 16384):
            out += h2wire.frame(h2wire.DATA, 0, sid, wire[i : i + 16384])
        return out

    async def connection(streams: int, frames: Callable[[int], bytes], refused: asyncio.Event | None = None) -> None:
        """Send ``streams`` calls; once the first six are answered (a connection holds at most two 1.5 MiB
        messages, so at least six of eight are refused at once) set ``refused``; then read every answer."""
        async with opened(setup) as wire:
            for i in range(streams):
                await wire.send(frames(1 + 2 * i))
            held.append(inputs.bytes.get("attacker", 0))
            if refused is not None:
                await wire.read_until(lambda fs: len(h2wire.statuses(fs)) >= 6, limit_s=30)
                refused.set()
            got = await wire.read_until(lambda fs: len(h2wire.statuses(fs)) >= streams, limit_s=30)
            answers.extend(h2wire.statuses(got).values())

    def waiting(sid: int) -> bytes:
        return h2wire.header_frames(sid, h2wire.grpc_headers(INFER, [key]))

    async def after(event: asyncio.Event, then: Awaitable[None]) -> None:
        await event.wait()
        await then

    async def attack(port: int) -> None:
        # In order, so that each bound is the one that trips: the first connection alone fills its own 3 MiB;
        # three more while it holds pass the tenant's 6 MiB; once all of those have ended (their memory given
        # back), the HEADERS-only calls pass the tenant's 64 waiting calls. Interleaved, the tenant's bytes bound
        # could trip before any connection's, or refuse the HEADERS-only calls (their metadata is held too).
        first = asyncio.Event()
        await asyncio.gather(connection(8, partial, first), *(after(first, connection(8, partial)) for _ in range(3)))
        await connection(WAITING + 16, waiting)

    victim, grown = under_attack(setup, attack)
    assert_unharmed(victim, grown)
    assert max(held) <= PER_TENANT
    assert len(answers) == 4 * 8 + WAITING + 16
    codes = [a["grpc-status"] for a in answers]
    assert set(codes) == {"8", "4"}, codes  # RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED
    refusals = " ".join(a["grpc-message"] for a in answers if a["grpc-status"] == "8")
    for why in ("on this connection", "this caller's unfinished calls", "calls of this caller are waiting"):
        assert why in refusals, refusals[:400]
    assert all("did not arrive within 3 s" in a["grpc-message"] for a in answers if a["grpc-status"] == "4")
    assert "attacker" not in inputs.bytes and "attacker" not in inputs.streams  # all given back


def test_a_client_that_never_reads_stops_being_read_and_is_closed(setup: Setup) -> None:
    """Issue 33 item 6: HEADERS-only calls without a key, each answered UNAUTHENTICATED, from a client that
    never reads (up to 16 MiB of them). The gateway stops reading the connection once 1 MiB of answers waits,
    so the client cannot send it all, and closes it once its output has not moved for ``body_timeout_s``."""
    outcome: dict[str, object] = {}

    def calls() -> Iterator[bytes]:
        encoder, sid = hpack.Encoder(), 1
        for _ in range(16 * MIB // 2**16):
            chunk = bytearray()
            while len(chunk) < 2**16:
                block = h2wire.grpc_headers(INFER, encoder=encoder)
                chunk += h2wire.frame(h2wire.HEADERS, h2wire.END_HEADERS | h2wire.END_STREAM, sid, block)
                sid += 2
            yield bytes(chunk)

    async def attack(port: int) -> None:
        async with opened(setup) as wire:
            outcome["sent"] = await send_until_cut(wire, calls())
            outcome["closed"] = await closed_by_server(wire, silence_s=15)

    victim, grown = under_attack(setup, attack)
    assert_unharmed(victim, grown)
    assert outcome["sent"] < 16 * MIB, outcome  # the gateway stopped reading
    assert outcome["closed"], outcome


def test_a_window_of_zero_is_closed_and_windows_past_2_31_are_errors(setup: Setup) -> None:
    """Zero window (CVE-2019-9517): a client announces an initial stream window of 0 and sends 16 valid calls,
    so no answer's DATA can leave; the gateway holds them for ``body_timeout_s`` of no progress, then closes the
    connection with GOAWAY saying why. Window overflow (RFC 9113 6.9.1): a WINDOW_UPDATE that takes the
    connection's window past 2^31-1 is GOAWAY FLOW_CONTROL_ERROR; one that takes a stream's past it resets
    that stream with FLOW_CONTROL_ERROR, and the connection's next call is answered."""
    key = ("authorization", f"Bearer {setup.attacker}")
    body = infer_message()
    outcome: dict[str, object] = {}
    window = h2wire.frame(h2wire.WINDOW_UPDATE, 0, 0, struct.pack(">I", 2**31 - 1))

    async def zero_window() -> None:
        async with opened(setup) as wire:
            await wire.send(h2wire.frame(h2wire.SETTINGS, 0, 0, struct.pack(">HI", 0x4, 0)))
            await wire.send(b"".join(h2wire.call(sid, INFER, [key], body) for sid in range(1, 33, 2)))
            outcome["zero closed"] = await closed_by_server(wire, silence_s=15)
            outcome["zero"] = goaway_of(wire)
            outcome["zero data"] = [f for f in h2wire.parse(wire.received) if f.kind == h2wire.DATA]

    async def connection_overflow() -> None:
        async with opened(setup) as wire:
            await wire.send(window)  # 65,535 + 2^31-1
            outcome["connection closed"] = await closed_by_server(wire)
            outcome["connection"] = goaway_of(wire)

    async def stream_overflow() -> None:
        async with opened(setup) as wire:
            await wire.send(h2wire.header_frames(1, h2wire.grpc_headers(INFER, [key])))  # its message to come
            await wire.send(h2wire.frame(h2wire.WINDOW_UPDATE, 0, 1, struct.pack(">I", 2**31 - 1)))
            await wire.send(h2wire.call(3, INFER, [key], body))
            got = await wire.read_until(lambda fs: h2wire.statuses(fs).get(3, {}).get("grpc-status"), limit_s=30)
            outcome["reset"] = [(f.stream, f.payload) for f in got if f.kind == h2wire.RST_STREAM]
            outcome["next"] = h2wire.statuses(got).get(3, {})
            outcome["stream goaway"] = h2wire.goaway(got)

    async def attack(port: int) -> None:
        await asyncio.gather(zero_window(), connection_overflow(), stream_overflow())

    victim, grown = under_attack(setup, attack)
    assert_unharmed(victim, grown)
    zero = outcome["zero"]
    assert outcome["zero closed"] and zero is not None, outcome
    assert zero[0] == ENHANCE_YOUR_CALM and b"output not taken for 3 s" in zero[1], zero  # type: ignore[index]
    assert outcome["zero data"] == []  # a window of 0 let no DATA out
    connection = outcome["connection"]
    assert outcome["connection closed"] and connection is not None, outcome
    assert connection[0] == FLOW_CONTROL_ERROR and b"connection window" in connection[1], connection  # type: ignore[index]
    assert outcome["reset"] == [(1, struct.pack(">I", FLOW_CONTROL_ERROR))], outcome
    assert outcome["next"].get("grpc-status") == "0" and outcome["stream goaway"] is None, outcome  # type: ignore[attr-defined]


FLOODS: dict[str, tuple[Callable[[str], bytes], int, bytes]] = {
    "PING": (lambda key: h2wire.frame(h2wire.PING, 0, 0, b"12345678") * 20_000, ENHANCE_YOUR_CALM, b"PINGs"),
    "SETTINGS": (lambda key: h2wire.frame(h2wire.SETTINGS, 0, 0) * 2_000, ENHANCE_YOUR_CALM, b"SETTINGS faster"),
    "SETTINGS entries": (
        lambda key: h2wire.frame(h2wire.SETTINGS, 0, 0, struct.pack(">HI", 0x2, 0) * 100),
        ENHANCE_YOUR_CALM,
        b"entries",
    ),
    "rapid reset": (
        lambda key: b"".join(
            h2wire.frame(h2wire.HEADERS, h2wire.END_HEADERS, sid, h2wire.grpc_headers(INFER, [("authorization", key)]))
            + h2wire.frame(h2wire.RST_STREAM, 0, sid, struct.pack(">I", 8))
            for sid in range(1, 6_001, 2)
        ),
        ENHANCE_YOUR_CALM,
        b"streams reset",
    ),
    "WINDOW_UPDATE": (
        lambda key: h2wire.frame(h2wire.WINDOW_UPDATE, 0, 0, struct.pack(">I", 1)) * 5_000,
        ENHANCE_YOUR_CALM,
        b"WINDOW_UPDATE",
    ),
    "zero WINDOW_UPDATE": (
        lambda key: h2wire.frame(h2wire.WINDOW_UPDATE, 0, 0, struct.pack(">I", 0)),
        PROTOCOL_ERROR,
        b"WINDOW_UPDATE of 0",
    ),
    "PRIORITY": (
        lambda key: h2wire.frame(h2wire.PRIORITY, 0, 1, struct.pack(">IB", 0, 16)) * 5_000,
        ENHANCE_YOUR_CALM,
        b"PRIORITY",
    ),
    "empty DATA": (
        lambda key: h2wire.frame(
            h2wire.HEADERS, h2wire.END_HEADERS, 1, h2wire.grpc_headers(INFER, [("authorization", key)])
        )
        + h2wire.frame(h2wire.DATA, 0, 1) * 1_000,
        ENHANCE_YOUR_CALM,
        b"empty frame",
    ),
}


def test_floods_of_frames_that_carry_no_call_get_goaway(setup: Setup) -> None:
    """Rapid reset (CVE-2023-44487), PING, SETTINGS (CVE-2019-9512/9515), WINDOW_UPDATE, PRIORITY
    (CVE-2019-9513) and empty frames (CVE-2019-9518), each sent in one write on its own connection with the
    attacker's key: each gets GOAWAY naming the bound it passed, and the victim sees nothing of it."""
    key = f"Bearer {setup.attacker}"
    away: dict[str, tuple[int, bytes] | None] = {}

    async def flood(name: str, wire_bytes: bytes) -> None:
        async with opened(setup) as wire:
            closed = asyncio.create_task(closed_by_server(wire))
            await send_until_cut(wire, iter([wire_bytes]))
            await closed
            away[name] = goaway_of(wire)

    async def attack(port: int) -> None:
        await asyncio.gather(*(flood(name, make(key)) for name, (make, _, _) in FLOODS.items()))

    victim, grown = under_attack(setup, attack)
    assert_unharmed(victim, grown)
    for name, (_, code, why) in FLOODS.items():
        got = away[name]
        assert got is not None and got[0] == code and why in got[1], (name, got)


def test_callers_without_a_key_do_not_share_one_budget(setup: Setup) -> None:
    """ServerLive and ServerReady need no key. An anonymous client that opens three connections of 40 calls each
    and never sends their messages (120, past the 64 waiting calls a tenant may have) holds each connection's
    calls on that connection's own budget: none is refused, and another anonymous caller's ServerReady, sent
    while they are held, is answered. Were callers without a key one owner, 56 of the 120 and the other caller's
    call would be RESOURCE_EXHAUSTED."""
    inputs = setup.cloud.cloud._fronts.grpc.server.inputs  # type: ignore[attr-defined]
    live, ready = h2wire.SERVICE + "ServerLive", h2wire.SERVICE + "ServerReady"
    per_connection = 40
    answers: list[dict[str, str]] = []
    held: list[int] = []
    all_held, probed = asyncio.Event(), asyncio.Event()

    async def hoarder(opened_all: list[int]) -> None:
        async with opened(setup) as wire:
            block = b"".join(h2wire.frame(h2wire.HEADERS, h2wire.END_HEADERS, 1 + 2 * i, h2wire.grpc_headers(live))
                             for i in range(per_connection))  # fmt: skip
            await wire.send(block + h2wire.frame(h2wire.PING, 0, 0, b"held-all"))
            # the PING's answer comes once every HEADERS before it was handled
            await wire.read_until(lambda fs: any(f.kind == h2wire.PING and f.flags & h2wire.ACK for f in fs))
            opened_all.append(1)
            if len(opened_all) == 3:
                held.append(sum(n for owner, n in inputs.streams.items() if owner != "victim"))
                all_held.set()
            await asyncio.wait_for(probed.wait(), 60)  # a deadline against a hang
            got = await wire.read_until(lambda fs: len(h2wire.statuses(fs)) >= per_connection, limit_s=30)
            answers.extend(h2wire.statuses(got).values())

    async def other_caller() -> dict[str, str]:
        await asyncio.wait_for(all_held.wait(), 60)
        async with opened(setup) as wire:
            await wire.send(h2wire.frame(h2wire.HEADERS, h2wire.END_HEADERS, 1, h2wire.grpc_headers(ready)))
            await wire.send(h2wire.frame(h2wire.DATA, h2wire.END_STREAM, 1, h2wire.message(b"")))
            got = await wire.read_until(lambda fs: "grpc-status" in h2wire.statuses(fs).get(1, {}), limit_s=30)
            probed.set()
            return h2wire.statuses(got).get(1, {})

    async def attack(port: int) -> None:
        opened_all: list[int] = []
        other = asyncio.create_task(other_caller())
        await asyncio.gather(*(hoarder(opened_all) for _ in range(3)))
        answers.append(await other)

    victim, grown = under_attack(setup, attack)
    assert_unharmed(victim, grown)
    assert held == [3 * per_connection], held  # every call held, none refused for another connection's
    *hoarded, other = answers
    assert other.get("grpc-status") == "0", other
    assert len(hoarded) == 3 * per_connection
    assert {a["grpc-status"] for a in hoarded} == {"4"}, hoarded[:3]  # each ran out its own time, none refused
    assert set(inputs.streams) <= {"victim"} and set(inputs.bytes) <= {"victim"}  # all given back
