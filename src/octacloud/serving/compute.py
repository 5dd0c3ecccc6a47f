"""A model's compute in a process of its own (config parameter ``compute: "process"``).

By default a replica computes its batches in its own process: inline on the event loop when batches are short,
else on a model thread (:mod:`octacloud.serving.batching.handoff`). Either way the replica's protocol work and
the model's compute share one process, and for a small model the one event loop saturates near one core while
the model's compute is a third of its time. With ``compute: "process"`` the model is loaded in a child process
(as Triton's python backend runs its stub): the replica's loop sends each batch over a Unix socket and goes on
with the protocol work while the child computes, and a model that crashes takes only its child down. What it
buys is that isolation, not speed: each batch costs two wake-ups across processes, and on the machines measured
(docs/serving.md) that cost more CPU than the compute it moved off the loop.

Mechanism, not policy: :class:`ComputeProcess` is a :class:`~octacloud.serving.runtime.ModelRuntime` whose
batches run in the child. It adds ``run_async`` (the batcher awaits it on the loop: no thread, no futex; the
answer wakes the loop through the socket), ``pid`` and ``resident_bytes`` (the child's, for the warm-up's
bytes-per-sample measurement). Its blocking ``run`` serves the warm-up, before the loop owns the socket.

Wire: frames of a 4-byte little-endian length and a pickle (protocol 5) between a replica and the child it
started over a private socketpair; nothing else can reach that socket. Parent → child: ``("load", factory,
version_dir, config bytes, threads)`` once, then ``("run", inputs, output names)``; child → parent:
``("ok", value)`` or ``("error", type name, message, config error?)``, one answer per frame in order.

Failures: a load the child refuses raises :class:`ModelConfigError` with the child's message. A child that dies
(kill -9, a crash in native code) fails the batches it held with :class:`ModelExecutionError` naming the exit
status; the next batch starts a new child, loads the model again and runs on it. The child exits when the
replica's end of the socket closes (the replica unloads the model, exits or is killed: the kernel closes a
killed process's sockets), after the batch it is computing, if any.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy.typing as npt
from tritonclient.grpc import model_config_pb2 as mc

from octacloud.serving.errors import ModelConfigError, ModelExecutionError
from octacloud.serving.memory import resident_bytes
from octacloud.serving.runtime import Arrays, RuntimeFactory
from octacloud.serving.types import TensorMetadata

log = logging.getLogger("octacloud.serving.compute")

PARAM_COMPUTE = "compute"
"""Config parameter: where a model's batches are computed. "replica" (the default): in the replica's process;
"process": in a child process of the replica (:class:`ComputeProcess`)."""
COMPUTE_VALUES = ("replica", "process")

_LENGTH = struct.Struct("<I")
_CLOSE_WAIT_S = 5.0
_CHILD = "import sys; from octacloud.serving.compute import main; sys.exit(main(sys.argv[1:]))"


def _child_env() -> dict[str, str]:
    """The replica's environment, with the folder this octacloud was imported from first on the child's path:
    the child runs the same code as its replica, installed or not."""
    import octacloud

    root = str(Path(octacloud.__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


def compute_mode(config: mc.ModelConfig) -> str:
    """The config's ``compute`` parameter, checked: one of :data:`COMPUTE_VALUES` ("replica" when absent)."""
    value = config.parameters[PARAM_COMPUTE].string_value if PARAM_COMPUTE in config.parameters else ""
    value = value or "replica"
    if value not in COMPUTE_VALUES:
        raise ModelConfigError(f"parameter {PARAM_COMPUTE!r} is {value!r}; choose one of {list(COMPUTE_VALUES)}")
    return value


def _frame(message: tuple[Any, ...]) -> bytes:
    body = pickle.dumps(message, protocol=5)
    return _LENGTH.pack(len(body)) + body


def _read_exactly(sock: socket.socket, n: int) -> bytes | None:
    """``n`` bytes from a blocking socket, or None at end of file."""
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _read_frame(sock: socket.socket) -> tuple[Any, ...] | None:
    head = _read_exactly(sock, _LENGTH.size)
    if head is None:
        return None
    body = _read_exactly(sock, _LENGTH.unpack(head)[0])
    if body is None:
        return None
    message = pickle.loads(body)
    assert isinstance(message, tuple)
    return message


class _Link(asyncio.Protocol):
    """The replica's end of the socket once the loop owns it: answers resolve the waiting batches in order."""

    def __init__(self, on_lost: Any) -> None:
        self.transport: asyncio.Transport | None = None
        self.pending: collections.deque[asyncio.Future[tuple[Any, ...]]] = collections.deque()
        self.alive = True
        self._buffer = bytearray()
        self._on_lost = on_lost

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio's subclasses

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        while len(buffer) >= _LENGTH.size:
            (n,) = _LENGTH.unpack_from(buffer)
            end = _LENGTH.size + n
            if len(buffer) < end:
                return
            message = pickle.loads(memoryview(buffer)[_LENGTH.size : end])
            del buffer[:end]
            if self.pending:
                future = self.pending.popleft()
                if not future.done():
                    future.set_result(message)

    def connection_lost(self, exc: Exception | None) -> None:
        self.alive = False
        error = self._on_lost()
        while self.pending:
            future = self.pending.popleft()
            if not future.done():
                future.set_exception(error)


class ComputeProcess:
    """A model loaded and computed in a child process. Blocking to create (it starts the child and waits for
    the load): call it from a worker thread."""

    def __init__(
        self, factory: RuntimeFactory, version_dir: Path, config: mc.ModelConfig, threads: int, name: str = ""
    ) -> None:
        self.name = name or version_dir.parent.name
        self._load = ("load", factory, str(version_dir), config.SerializeToString(), threads)
        self._link: _Link | None = None
        self._preparing: asyncio.Task[None] | None = None
        self._closed = False
        self.restarts = 0
        self._start()

    # ---- the child -------------------------------------------------------------------------------------------
    def _start(self) -> None:
        """Start a child and load the model in it (blocking)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env=_child_env(),
            )
        except OSError as e:
            ours.close()
            raise ModelConfigError(f"model {self.name!r}: cannot start its compute process: {e}") from None
        finally:
            theirs.close()
        self._sock = ours
        error: OSError | None = None
        try:
            ours.sendall(_frame(self._load))
            answer = _read_frame(ours)
        except OSError as e:
            answer, error = None, e
        if answer is None or answer[0] != "ok":
            self._stop_child()
            if answer is None:
                raise ModelConfigError(
                    f"model {self.name!r}: its compute process exited while loading it "
                    f"({self._exit_words()}{f'; {error}' if error else ''})"
                )
            raise (ModelConfigError if answer[3] else ModelExecutionError)(answer[2])
        inputs, outputs, device, couples = answer[1]
        self._inputs: tuple[TensorMetadata, ...] = inputs
        self._outputs: tuple[TensorMetadata, ...] = outputs
        self._device: str = device
        self.couples_rows: bool = couples

    def _exit_words(self) -> str:
        code = self._proc.poll()
        if code is None:
            return "still running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit status {code}"

    def _stop_child(self) -> None:
        try:
            self._sock.close()
        finally:
            try:
                self._proc.wait(_CLOSE_WAIT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def resident_bytes(self) -> int:
        """The child's resident memory (where the model's memory is), 0 when it is gone."""
        return resident_bytes(self._proc.pid)

    # ---- ModelRuntime -------------------------------------------------------------------------------------------
    @property
    def inputs(self) -> Sequence[TensorMetadata]:
        return self._inputs

    @property
    def outputs(self) -> Sequence[TensorMetadata]:
        return self._outputs

    @property
    def device(self) -> str:
        return self._device

    def run(self, inputs: Arrays, outputs: Sequence[str]) -> dict[str, npt.NDArray[Any]]:
        """One batch, blocking (the warm-up's path; batches on the loop go through :meth:`run_async`)."""
        if self._link is not None:
            raise RuntimeError("the event loop owns the compute process: use run_async")
        try:
            self._sock.sendall(_frame(("run", dict(inputs), tuple(outputs))))
            answer = _read_frame(self._sock)
        except OSError:
            answer = None
        if answer is None:
            raise ModelExecutionError(f"model {self.name!r}: its compute process is gone ({self._exit_words()})")
        return self._result(answer)

    async def run_async(self, inputs: Arrays, outputs: Sequence[str]) -> dict[str, npt.NDArray[Any]]:
        """One batch on the child, awaited on the loop; a dead child is replaced first."""
        link = self._link
        if link is None or not link.alive:
            link = await self._ready_link()
        future: asyncio.Future[tuple[Any, ...]] = asyncio.get_running_loop().create_future()
        link.pending.append(future)
        assert link.transport is not None
        link.transport.write(_frame(("run", dict(inputs), tuple(outputs))))
        return self._result(await future)

    async def _ready_link(self) -> _Link:
        """The link to a live child: the socket handed to the loop on the first batch, a dead child replaced
        (one start for every batch waiting on it)."""
        if self._closed:
            raise ModelExecutionError(f"model {self.name!r}: its compute process is closed")
        if self._preparing is None:
            self._preparing = asyncio.get_running_loop().create_task(self._prepare())
        task = self._preparing
        try:
            await asyncio.shield(task)
        finally:
            if self._preparing is task and task.done():
                self._preparing = None
        link = self._link
        if self._closed or link is None:
            raise ModelExecutionError(f"model {self.name!r}: its compute process is closed")
        if not link.alive:
            raise ModelExecutionError(f"model {self.name!r}: its compute process stopped again as it started")
        return link

    async def _prepare(self) -> None:
        if self._link is not None and not self._link.alive:
            self.restarts += 1
            dead = self._proc
            try:
                await asyncio.to_thread(dead.wait, _CLOSE_WAIT_S)
            except subprocess.TimeoutExpired:
                dead.kill()
            log.warning("model %s: its compute process (pid %d) stopped (%s); starting another",
                        self.name, dead.pid, self._exit_words())  # fmt: skip
            self._link = None
            try:
                await asyncio.to_thread(self._start)
            except Exception as e:
                raise ModelExecutionError(
                    f"model {self.name!r}: its compute process could not be restarted: {e}"
                ) from e
            if self._closed:  # closed while the new child loaded
                self._stop_child()
                return
        if self._link is None:
            self._sock.setblocking(False)
            _, self._link = await asyncio.get_running_loop().connect_accepted_socket(
                lambda: _Link(self._lost), sock=self._sock
            )

    def _lost(self) -> ModelExecutionError:
        return ModelExecutionError(
            f"model {self.name!r}: its compute process (pid {self.pid}) stopped during the batch; "
            "another is started for the next one"
        )

    def _result(self, answer: tuple[Any, ...]) -> dict[str, npt.NDArray[Any]]:
        if answer[0] == "ok":
            value: dict[str, npt.NDArray[Any]] = answer[1]
            return value
        raise ModelExecutionError(f"model {self.name!r} failed: {answer[1]}: {answer[2]}")

    def close(self) -> None:
        """Stop the child: it sees the socket close, frees the model and exits. Blocks until it has (at most a
        few seconds, then it is killed); called once the model has no batch left."""
        self._closed = True
        if self._link is not None and self._link.transport is not None:
            self._link.transport.close()
        self._stop_child()


# ---- the child process ----------------------------------------------------------------------------------------
def _error(e: BaseException) -> tuple[Any, ...]:
    return ("error", type(e).__name__, str(e), isinstance(e, ModelConfigError))


def serve(sock: socket.socket) -> None:
    """The child's loop: load what the first frame names, then answer each batch until the socket closes."""
    first = _read_frame(sock)
    if first is None:
        return
    _, factory, version_dir, config_bytes, threads = first
    config = mc.ModelConfig()
    config.ParseFromString(config_bytes)
    try:
        runtime = factory(Path(version_dir), config, threads)
        meta = (tuple(runtime.inputs), tuple(runtime.outputs), runtime.device, getattr(runtime, "couples_rows", False))
    except Exception as e:
        sock.sendall(_frame(_error(e)))
        return
    sock.sendall(_frame(("ok", meta)))
    try:
        while (message := _read_frame(sock)) is not None:
            try:
                answer: tuple[Any, ...] = ("ok", runtime.run(message[1], message[2]))
            except Exception as e:  # the batch fails, the child goes on
                answer = _error(e)
            sock.sendall(_frame(answer))
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        runtime.close()


def main(argv: Sequence[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: (started by a replica) octacloud.serving.compute.main([FD])", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the replica's to handle; it closes the socket
    sock = socket.socket(fileno=int(argv[0]))
    try:
        serve(sock)
    finally:
        sock.close()
    return 0
