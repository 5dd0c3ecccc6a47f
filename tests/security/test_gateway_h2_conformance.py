"""The gateway's gRPC front against nghttp2's own clients (Debian's ``nghttp2-client``, ``make nghttp``): ``h2load``
drives valid gRPC calls over many connections and streams (plain h2c, prior knowledge) and every one is answered
in full; ``nghttp -v`` makes one call and the exchange it prints is a conforming one (SETTINGS acknowledged both
ways, the answer's headers, its message and trailers with ``grpc-status: 0``, no RST_STREAM and no GOAWAY).

Skipped, saying so, where the binaries are absent."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from tests import h2wire
from tests.cluster.conftest import write_linear_model
from tests.cluster.test_cloud_e2e import config
from tests.security.test_gateway_h2_headers import INFER, Setup, infer_message, victim_and_attacker

pytestmark = pytest.mark.slow

H2LOAD, NGHTTP = shutil.which("h2load"), shutil.which("nghttp")
GRPC = ["-H", "content-type: application/grpc", "-H", "te: trailers"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("h2-conformance")
    write_linear_model(root / "models")
    cfg = config(root, root / "models")
    cfg.limits = replace(cfg.limits, max_inflight_per_replica=64)  # h2load's streams are not load to shed
    with victim_and_attacker(cfg) as s:
        yield s


@pytest.fixture
def message(tmp_path: Path) -> Path:
    path = tmp_path / "infer.grpc"
    path.write_bytes(h2wire.message(infer_message()))
    return path


def url(setup: Setup) -> str:
    return f"http://127.0.0.1:{setup.grpc_port}{INFER}"


def nghttp_call(setup: Setup, message: Path) -> str:
    assert NGHTTP is not None
    auth = ["-H", f"authorization: Bearer {setup.victim}"]
    done = subprocess.run([NGHTTP, "-v", "-n", *GRPC, *auth, "-d", str(message), url(setup)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


@pytest.mark.skipif(NGHTTP is None, reason="nghttp is not installed (Debian's nghttp2-client; `make nghttp`)")
def test_nghttp_sees_a_conforming_exchange(setup: Setup, message: Path) -> None:
    out = nghttp_call(setup, message)
    assert re.search(r"recv SETTINGS frame <length=\d+, flags=0x00, stream_id=0>", out), out
    assert re.search(r"recv SETTINGS frame <length=0, flags=0x01, stream_id=0>", out), out  # ours acknowledged
    sent = re.search(r"send HEADERS frame <length=\d+, flags=0x\w+, stream_id=(\d+)>", out)  # the call's
    assert sent, out
    sid = sent.group(1)  # nghttp opens streams of its own first (its PRIORITY tree)
    assert f"recv (stream_id={sid}) :status: 200" in out, out
    assert f"recv (stream_id={sid}) content-type: application/grpc" in out, out
    assert f"recv (stream_id={sid}) grpc-status: 0" in out, out
    assert re.search(rf"recv DATA frame <length=\d+, flags=0x00, stream_id={sid}>", out), out  # the answer
    assert re.search(rf"recv HEADERS frame <length=\d+, flags=0x05, stream_id={sid}>", out), out  # trailers end it
    assert "RST_STREAM" not in out and "recv GOAWAY" not in out, out


@pytest.mark.skipif(H2LOAD is None or NGHTTP is None, reason="h2load or nghttp is not installed (`make nghttp`)")
def test_h2load_calls_are_all_answered_in_full(setup: Setup, message: Path) -> None:
    """1,000 calls over 2 connections of up to 4 concurrent streams each (within what the replica takes at once on
    a loaded machine, so that none is shed): h2load counts every one succeeded (HTTP 200), and the gateway billed
    every one with the bytes of a complete answer, as one call alone has."""
    assert H2LOAD is not None
    traffic = setup.cloud.cloud.routes.tenant_traffic("victim", "v-lin")
    before = traffic.copy()
    nghttp_call(setup, message)
    one = traffic.bytes_out - before.bytes_out
    assert traffic.requests == before.requests + 1 and one > 0
    n, start = 1000, traffic.copy()
    auth = ["-H", f"authorization: Bearer {setup.victim}"]
    done = subprocess.run([H2LOAD, "-n", str(n), "-c", "2", "-m", "4", *GRPC, *auth, "-d", str(message), url(setup)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"requests: {n} total, {n} started, {n} done, {n} succeeded, 0 failed, 0 errored" in done.stdout, done.stdout
    assert f"status codes: {n} 2xx" in done.stdout, done.stdout
    billed = (traffic.requests - start.requests, traffic.bytes_out - start.bytes_out)
    assert billed == (n, n * one), (billed, one, done.stdout)  # each a complete answer, as the single call's
