"""``octacloud node start``: a real ``ray start`` whose node advertises a fleet-file node, read back as the cloud
reads its fleet (in a separate driver process: this one may already be connected to another cluster)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from octacloud.control.launcher import free_port

pytestmark = pytest.mark.slow

FLEET = """
nodes:
  - name: edge-1
    cpu_milli: 2000
    memory_mib: 8192
    labels: {zone: lab}
    gpus:
      - {model: T4, memory_mib: 16384, nvlink_group: 0}
      - {model: T4, memory_mib: 16384, nvlink_group: 0}
      - {model: T4, memory_mib: 16384}
  - name: other
    cpu_milli: 1000
    memory_mib: 1024
"""

PROBE = """
import json, sys
from octacloud.control.ray.backend import RayFleet, connect
connect(sys.argv[1])
print(json.dumps([{"name": n.name, "cpu": n.cpu_milli, "labels": dict(n.labels),
                   "gpus": [[g.model, g.memory_mib, g.nvlink_group] for g in n.gpus]} for n in RayFleet().discover()]))
"""


def test_node_start_advertises_the_inventory(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(FLEET)
    port = free_port()
    temp = Path(f"/tmp/octacloud-node-{os.getpid()}")
    env = {**os.environ, "RAY_TMPDIR": str(temp), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    octacloud = [sys.executable, "-m", "octacloud"]
    dry = subprocess.run(
        [*octacloud, "node", "start", "--head", "--fleet", str(fleet), "--fleet-node", "edge-1", "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert '"gpu2_octant": 8.0' in dry.stdout and "octacloud.io/nvlink-groups=0-0-x" in dry.stdout
    assert "--num-gpus=0" in dry.stdout

    argv = [*octacloud, "node", "start", "--head", "--fleet", str(fleet), "--fleet-node", "edge-1"]
    log = (tmp_path / "node.log").open("w")
    # its own session: everything `ray start` spawns can be stopped through this one process group
    argv += [f"--port={port}", "--block"]
    node = subprocess.Popen(argv, env=env, stdout=log, stderr=log, start_new_session=True)
    try:
        seen: list[dict[str, object]] = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not seen:
            assert node.poll() is None, (tmp_path / "node.log").read_text()[-2000:]
            probe = subprocess.run(
                [sys.executable, "-c", PROBE, f"127.0.0.1:{port}"], capture_output=True, text=True, env=env, timeout=60
            )
            if probe.returncode == 0:
                seen = json.loads(probe.stdout.strip().splitlines()[-1])
            else:
                time.sleep(1)
        assert seen == [
            {
                "name": "edge-1",
                "cpu": 2000,
                "labels": {"octacloud.io/zone": "lab"},
                "gpus": [["T4", 16384, 0], ["T4", 16384, 0], ["T4", 16384, None]],
            }
        ]
    finally:
        node.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            node.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait(timeout=10)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)
