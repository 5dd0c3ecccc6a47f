"""The per-cloud internal secret: made once with mode 0600, refused when others may read it, handed to
every replica by path, and sent by the gateway (checked in tests/reliability/test_gateway_http.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from octacloud.control.launcher import LaunchSpec, LocalProcessLauncher
from octacloud.core.errors import InvalidSpecError
from octacloud.security import internal_auth
from tests.cluster.conftest import write_linear_model


def test_the_secret_is_made_once_private_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "state" / internal_auth.FILE_NAME
    first = internal_auth.ensure_secret(path)
    assert len(first) >= 32 and path.stat().st_mode & 0o777 == 0o600
    assert internal_auth.ensure_secret(path) == first  # a restart keeps it: running replicas still accept us
    assert internal_auth.matches(first, first.encode()) and not internal_auth.matches(first, "x" * len(first))
    assert not internal_auth.matches(first, None)
    path.chmod(0o644)
    with pytest.raises(InvalidSpecError, match="readable by others"):
        internal_auth.read_secret(path)
    path.chmod(0o600)
    path.write_text("short")
    with pytest.raises(InvalidSpecError, match="shorter than 32"):
        internal_auth.read_secret(path)


def test_secret_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(internal_auth.ENV_VAR, raising=False)
    assert internal_auth.secret_from_env() is None
    secret = internal_auth.ensure_secret(tmp_path / "s")
    monkeypatch.setenv(internal_auth.ENV_VAR, str(tmp_path / "s"))
    assert internal_auth.secret_from_env() == secret


def test_local_replicas_get_the_secret_file_and_bind_loopback(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    write_linear_model(repo)
    secret_file = tmp_path / internal_auth.FILE_NAME
    internal_auth.ensure_secret(secret_file)
    launcher = LocalProcessLauncher(
        tmp_path / "replicas", environment=lambda: {internal_auth.ENV_VAR: str(secret_file)}
    )
    launched = launcher.launch(LaunchSpec("r1", "linear", repo / "linear", "", {}, 1))
    try:
        assert launched.address is not None and launched.address.host == "127.0.0.1"
        # posix_spawn returns once the child has left the parent's memory, a moment before the kernel has set up
        # the new program's environment: until then /proc/PID/environ reads empty
        deadline = time.monotonic() + 10
        while not (raw := Path(f"/proc/{launched.handle}/environ").read_bytes()) and time.monotonic() < deadline:
            time.sleep(0.01)
        environ = raw.split(b"\0")
        assert f"{internal_auth.ENV_VAR}={secret_file}".encode() in environ
    finally:
        launcher.stop(launched.handle, 2.0)
    assert not launcher.alive(launched.handle)
