"""A fake ``nvidia-cuda-mps-control``: the same command line and stdin protocol, recording every command.

``-d`` starts a detached "daemon" process (its PID in ``$CUDA_MPS_PIPE_DIRECTORY/daemon.pid``); without ``-d``
the commands on stdin are answered: ``get_server_list`` prints the PIDs listed in ``<pipe>/servers`` (a test
writes them to play a server starting or crashing), ``quit`` ends the daemon. With no daemon alive, a command
fails as the real client does (exit 1, "Cannot find MPS control daemon process"). Every invocation is appended
to ``<pipe>/commands.log`` with the environment variables MPS reads.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def write_fake(folder: Path) -> Path:
    """An executable ``nvidia-cuda-mps-control`` in ``folder`` that runs this module."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "nvidia-cuda-mps-control"
    path.write_text(
        f"#!{sys.executable}\nimport runpy, sys\nsys.argv[0] = {str(path)!r}\n"
        f"runpy.run_path({__file__!r}, run_name='__main__')\n"
    )
    path.chmod(0o755)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def main() -> int:
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    log = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"))
    pipe.mkdir(parents=True, exist_ok=True)
    pid_file = pipe / "daemon.pid"
    args = sys.argv[1:]
    if args == ["--serve"]:
        pid_file.write_text(str(os.getpid()))
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        while True:
            time.sleep(0.05)
    stdin = "" if args == ["-d"] else sys.stdin.read()
    with (pipe / "commands.log").open("a") as f:
        f.write(f"{' '.join(args) or '-'}|{stdin.strip()}|pipe={pipe}|log={log}\n")
    if args == ["-d"]:
        subprocess.Popen(
            [sys.executable, __file__, "--serve"],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return 0
    pid = int(pid_file.read_text()) if pid_file.exists() else 0
    if not pid or not _alive(pid):
        print("Cannot find MPS control daemon process", file=sys.stderr)
        return 1
    for command in stdin.split("\n"):
        command = command.strip()
        if command == "get_server_list":
            servers = pipe / "servers"
            print(servers.read_text() if servers.exists() else "", end="")
        elif command == "quit":
            os.kill(pid, signal.SIGTERM)
            pid_file.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
