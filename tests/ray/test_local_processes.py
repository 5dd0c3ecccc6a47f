"""Finding every process of a local Ray node to kill it as a lost server: the process tree read from /proc."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from octacloud.control.ray.local import descendants


def test_descendants_are_every_process_below_the_roots() -> None:
    shell = subprocess.Popen(["sh", "-c", "sleep 60 & (sleep 61 & wait) & wait"])
    try:
        deadline = time.monotonic() + 30  # against a hang: the shell starts its children when it runs
        while len(found := descendants([shell.pid])) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        commands = sorted(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode() for pid in found)
        assert commands == ["sh -c sleep 60 & (sleep 61 & wait) & wait ", "sleep 60 ", "sleep 61 "], commands
        assert shell.pid not in found and descendants([]) == []
    finally:
        for pid in [*descendants([shell.pid]), shell.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shell.wait(timeout=30)
