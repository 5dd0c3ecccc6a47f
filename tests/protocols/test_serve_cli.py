"""``octacloud serve`` as a process: binds 127.0.0.1, serves REST and gRPC, stops cleanly on SIGTERM/SIGINT;
and perf_analyzer (when bench/peers/setup.sh installed it) runs against it unmodified."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from octacloud.serving.testing import mlp_onnx, write_onnx_model

PERF_ANALYZER = Path(os.environ.get("OCTACLOUD_PEERS", Path.home() / ".cache" / "octacloud-peers")) / (
    "perf_analyzer/run-perf_analyzer"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def octacloud() -> str:
    exe = Path(sys.executable).parent / "octacloud"
    return str(exe) if exe.exists() else shutil.which("octacloud") or "octacloud"


class Served:
    def __init__(self, proc: subprocess.Popen[bytes], http: int, grpc: int, metrics: int) -> None:
        self.proc, self.http, self.grpc, self.metrics = proc, http, grpc, metrics


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    repo = tmp_path_factory.mktemp("repo")
    write_onnx_model(repo, "mlp", mlp_onnx((16, 32, 4)))
    http, grpc, metrics = free_port(), free_port(), free_port()
    log = repo / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                octacloud(),
                "serve",
                "--repository",
                str(repo),
                "--http-port",
                str(http),
                "--grpc-port",
                str(grpc),
                "--metrics-port",
                str(metrics),
                "--threads",
                "1",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=1) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            pytest.fail(f"octacloud serve did not start: {log.read_text()}")
        time.sleep(0.2)
    yield Served(proc, http, grpc, metrics)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_serves_rest_grpc_and_metrics_on_loopback_only(served: Served) -> None:
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
def test_perf_analyzer_runs_unmodified(served: Served, protocol: str) -> None:
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


def test_zz_sigterm_stops_the_server_cleanly(served: Served) -> None:
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(timeout=30) == 0
