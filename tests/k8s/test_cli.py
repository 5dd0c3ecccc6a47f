"""`octacloud k8s extender` as a process: serves kube-scheduler's JSON, survives bad input, refuses bad options."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from octacloud.control.launcher import free_port

from .wire import args_names, pod

FLEET = """
nodes:
  - {name: n1, cpu_milli: 32000, memory_mib: 131072, gpu_count: 4, gpu_model: A100, gpu_memory_mib: 81920}
  - {name: n2, cpu_milli: 32000, memory_mib: 131072, gpu_count: 4, gpu_model: A100, gpu_memory_mib: 81920}
"""


def start(fleet: Path, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    cmd = [sys.executable, "-m", "octacloud", "k8s", "extender", "--no-api", "--fleet", str(fleet), "--port", str(port)]
    log = fleet.parent / f"extender-{port}.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            if proc.poll() is not None:
                raise AssertionError(log.read_text()) from None
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("extender did not start")


@pytest.mark.slow
def test_extender_process_serves_and_survives_kill(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(FLEET)
    port = free_port()
    proc = start(fleet, port)
    try:
        url = f"http://127.0.0.1:{port}"
        bad = httpx.post(f"{url}/filter", content=b"\x00garbage", timeout=10)
        assert bad.status_code == 200 and "not JSON" in bad.json()["Error"]
        good = httpx.post(f"{url}/filter", json=args_names(pod("p", 4), ["n1", "n2"]), timeout=10).json()
        assert good["Error"] == "" and len(good["NodeNames"]) == 1
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc = start(fleet, port)
        again = httpx.post(f"{url}/filter", json=args_names(pod("q", 4), ["n1", "n2"]), timeout=10).json()
        assert again["NodeNames"] == good["NodeNames"]  # same decision on the same (empty: never bound) state
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_bad_options_are_refused(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    for args, message in (
        (["extender", "--no-api"], "--no-api needs --fleet"),
        (["extender", "--fleet", str(tmp_path / "missing.yaml"), "--no-api"], "cannot read fleet file"),
        (["extender", "--resync", "0", "--no-api"], "--resync must be > 0"),
        (["device-plugin", "--no-api", "--resources", "tpus"], "expected octants and/or gpus"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "octacloud", "k8s", *args], env=env, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 2, out
        assert message in " ".join(out.stderr.split()), out.stderr
