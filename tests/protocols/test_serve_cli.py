"""``octacloud serve`` as a process: binds 127.0.0.1, serves REST and gRPC, stops cleanly on SIGTERM/SIGINT;
and perf_analyzer (when bench/peers/setup.sh installed it) runs against it unmodified."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from octacloud.serving.testing import mlp_onnx, write_onnx_model
from tests.serve_process import ServeProcess, serve_process

PERF_ANALYZER = Path(os.environ.get("OCTACLOUD_PEERS", Path.home() / ".cache" / "octacloud-peers")) / (
    "perf_analyzer/run-perf_analyzer"
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    repo = tmp_path_factory.mktemp("repo")
    write_onnx_model(repo, "mlp", mlp_onnx((16, 32, 4)))
    with serve_process(repo, timeout=60) as s:
        yield s


def test_serves_rest_grpc_and_metrics_on_loopback_only(served: ServeProcess) -> None:
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc}")
    assert c.is_model_ready("mlp")
    c.close()
    with urllib.request.urlopen(f"http://127.0.0.1:{served.metrics}/metrics", timeout=5) as r:
        assert b"nv_inference_count" in r.read()
    listening = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout if shutil.which("ss") else ""
    for line in listening.splitlines():
        if f"pid={served.proc.pid}," in line:
            assert "127.0.0.1" in line.split()[3], line  # 127.0.0.1:P or [::ffff:127.0.0.1]:P


@pytest.mark.skipif(not PERF_ANALYZER.exists(), reason="perf_analyzer not set up (bench/peers/setup.sh)")
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_runs_unmodified(served: ServeProcess, protocol: str) -> None:
    port = served.http if protocol == "http" else served.grpc
    run = subprocess.run(
        [
            str(PERF_ANALYZER),
            "-m",
            "mlp",
            "-u",
            f"127.0.0.1:{port}",
            "-i",
            protocol,
            "--shape",
            "input:16",
            "--concurrency-range",
            "2",
            "-p",
            "500",
            "-s",
            "999",  # any window counts as stable: this checks the protocol, not the machine's noise
            "-r",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Throughput:" in run.stdout


def test_zz_sigterm_stops_the_server_cleanly(served: ServeProcess) -> None:
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(timeout=30) == 0


def test_a_handed_over_descriptor_that_is_not_a_bound_socket_is_refused_by_name(tmp_path: Path) -> None:
    """``--http-fd`` and its siblings take a socket a launcher bound: stdin-stdout-stderr, a closed descriptor,
    a file or an unbound socket is a clear error naming what was wrong, not a traceback."""
    import socket
    import sys

    repo = tmp_path / "repo"
    write_onnx_model(repo, "mlp", mlp_onnx((16, 32, 4)))
    base = [sys.executable, "-m", "octacloud", "serve", "--repository", str(repo), "--host", "127.0.0.1"]
    ports = ["--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"]

    def serve(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*base, *ports, *args], capture_output=True, text=True, timeout=60, **kw)  # type: ignore[call-overload]

    low = serve("--grpc-fd", "2")
    assert low.returncode == 2 and "--grpc-fd" in low.stderr and "3 or more" in low.stderr
    closed = serve("--http-fd", "1000")
    assert closed.returncode == 1 and "REST socket (file descriptor 1000) is not an open socket" in closed.stderr
    a_file = (tmp_path / "f").open("w")
    unbound = socket.socket()
    try:
        kept = {"pass_fds": (a_file.fileno(), unbound.fileno())}
        not_socket = serve("--metrics-fd", str(a_file.fileno()), **kept)
        assert not_socket.returncode == 1 and "metrics socket" in not_socket.stderr, not_socket.stderr
        no_port = serve("--grpc-fd", str(unbound.fileno()), **kept)
        assert no_port.returncode == 1 and "is not bound to a port" in no_port.stderr, no_port.stderr
    finally:
        a_file.close()
        unbound.close()
