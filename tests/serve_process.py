"""``octacloud serve`` as a real process on free loopback ports, for tests: started, waited for until ready,
stopped by its PID on exit; its log goes to a private temporary folder (never beside the repository)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def octacloud_executable() -> str:
    exe = Path(sys.executable).parent / "octacloud"
    return str(exe) if exe.exists() else shutil.which("octacloud") or "octacloud"


@dataclass(frozen=True, slots=True)
class ServeProcess:
    proc: subprocess.Popen[bytes]
    http: int
    grpc: int
    metrics: int
    """-1 when metrics were off."""
    log: Path


@contextmanager
def serve_process(
    repo: Path, *args: str, metrics: bool = True, threads: int = 1, timeout: float = 120
) -> Iterator[ServeProcess]:
    http, grpc = free_port(), free_port()
    metrics_port = free_port() if metrics else -1
    log = Path(tempfile.mkdtemp(prefix="octacloud-serve-")) / "serve.log"
    argv = [
        octacloud_executable(), "serve", "--repository", str(repo), "--http-port", str(http),
        "--grpc-port", str(grpc), "--metrics-port", str(metrics_port), "--threads", str(threads), *args,
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"octacloud serve did not start: {log.read_text()}")
            time.sleep(0.2)
        yield ServeProcess(proc, http, grpc, metrics_port, log)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(log.parent, ignore_errors=True)
