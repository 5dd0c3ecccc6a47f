"""The engine of a generative model: llama.cpp's ``llama-server``, one process per loaded version.

The replica starts it as its child (as Triton's vLLM backend runs vLLM inside Triton), on a Unix socket in a
folder only this process may enter, with a fresh API key in a file of mode 0600: nothing else on the host can
reach it, and the replica's own endpoints (behind the cloud's internal secret) are the only way in. The child
dies with the replica, ``kill -9`` included (``PR_SET_PDEATHSIG``), so no engine outlives its replica.

The engine's scheduler does the continuous batching: ``parallel`` slots, each a sequence of up to
``context_length`` tokens; a request joins a free slot between two decoding steps and leaves it at its last
token; closing a request's connection stops its generation.

Where the binary is: ``$OCTACLOUD_LLAMA_SERVER``, else ``llama-server`` beside this Python (``make llm`` links the
cached build into the virtualenv's ``bin/``), else on ``PATH``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from octacloud.serving.errors import ModelConfigError
from octacloud.serving.generate.client import Answer, StreamError, Target, request

log = logging.getLogger(__name__)

ENGINE_ENV = "OCTACLOUD_LLAMA_SERVER"
START_TIMEOUT_S = 120.0
STOP_GRACE_S = 5.0
_PR_SET_PDEATHSIG = 1
_LOG_TAIL_BYTES = 4000


def find_llama_server() -> Path:
    """The llama-server binary (see the module docstring); :class:`ModelConfigError` saying how to get it."""
    named = os.environ.get(ENGINE_ENV, "")
    if named:
        path = Path(named)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ModelConfigError(f"{ENGINE_ENV}={named} is not an executable file")
        return path
    beside = Path(sys.prefix) / "bin" / "llama-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("llama-server")
    if found:
        return Path(found)
    raise ModelConfigError(
        "llama-server (the engine of generative models) is not installed: run `make llm`, which builds it from "
        f"the pinned llama.cpp sources, or set {ENGINE_ENV} to its path"
    )


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before prctl: do not start at all
        os._exit(1)


class LlamaServer:
    """One llama-server process. :meth:`start` returns once it serves (``GET /health`` answers 200)."""

    def __init__(self, binary: Path, flags: Sequence[str], label: str) -> None:
        self.binary = binary
        self.flags = list(flags)
        self.label = label
        self._dir = Path(tempfile.mkdtemp(prefix="octacloud-engine-"))  # mode 0700
        self.socket = self._dir / "engine.sock"
        key = secrets.token_urlsafe(32)
        key_file = self._dir / "key"
        key_file.write_text(key + "\n")
        key_file.chmod(0o600)
        self._key_file = key_file
        self.auth = (b"authorization", b"Bearer " + key.encode())
        self.target = Target(path=str(self.socket))
        self._log = self._dir / "engine.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def argv(self) -> list[str]:
        return [str(self.binary), *self.flags, "--host", str(self.socket), "--api-key-file", str(self._key_file)]

    async def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Spawn it (on the event loop's thread: the child's death signal follows the thread that forked it,
        and this one lives as long as the replica) and wait until it serves; :class:`ModelConfigError` with the
        tail of its log when it exits or does not come up within ``timeout_s``."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_")}  # its flags come from us only
        with open(self._log, "wb") as out:
            self._process = subprocess.Popen(
                self.argv(), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                preexec_fn=_die_with_parent, close_fds=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while True:
            if self._process.poll() is not None:
                raise ModelConfigError(
                    f"{self.label}: llama-server exited with status {self._process.returncode} while starting: "
                    f"{self.log_tail()}"
                )
            if await self._healthy():
                log.info("%s: llama-server %d serving on %s", self.label, self._process.pid, self.socket)
                return
            if time.monotonic() > deadline:
                await self.stop()
                raise ModelConfigError(
                    f"{self.label}: llama-server did not come up in {timeout_s:g} s: {self.log_tail()}"
                )
            await asyncio.sleep(0.05)

    async def _healthy(self) -> bool:
        if not self.socket.exists():
            return False
        try:
            answer = await request(self.target, b"GET", b"/health", [self.auth], head_timeout=2.0)
            await answer.read()
        except (StreamError, TimeoutError):
            return False
        return answer.status == 200

    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def log_tail(self) -> str:
        try:
            with open(self._log, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - _LOG_TAIL_BYTES))
                text = f.read().decode(errors="replace")
        except OSError:
            return "(no log)"
        lines = [line for line in text.splitlines() if line.strip()]
        return " | ".join(lines[-8:]) or "(empty log)"

    async def open(self, method: bytes, path: bytes, body: bytes = b"", head_timeout: float | None = None) -> Answer:
        """One request to the engine; the answer's head is back on return (its body streams)."""
        headers = [self.auth, (b"content-type", b"application/json")]
        return await request(self.target, method, path, headers, body, head_timeout=head_timeout)

    async def call(self, path: bytes, payload: object, timeout: float = 30.0) -> tuple[int, object]:
        """A small JSON exchange (tokenize, health, slots): status and decoded body."""
        method = b"GET" if payload is None else b"POST"
        data = b"" if payload is None else json.dumps(payload).encode()
        answer = await self.open(method, path, data, head_timeout=timeout)
        body = await answer.read()
        try:
            return answer.status, json.loads(body) if body else None
        except ValueError:
            return answer.status, body.decode(errors="replace")

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM, up to ``grace_s`` for it to go, then SIGKILL; the private folder is removed."""
        process = self._process
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while process.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await asyncio.to_thread(process.wait)
        shutil.rmtree(self._dir, ignore_errors=True)
