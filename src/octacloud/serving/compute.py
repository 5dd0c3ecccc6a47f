"""A model's compute in a process of its own (config parameter ``compute: "process"``).

By default a replica computes its batches in its own process: inline on the event loop when batches are short,
else on a model thread (:mod:`octacloud.serving.batching.handoff`). Either way the replica's protocol work and
the model's compute share one process, and for a small model the one event loop saturates near one core while
the model's compute is a third of its time. With ``compute: "process"`` the model is loaded in a child process
(as Triton's python backend runs its stub): the replica's loop sends each batch over a Unix socket and goes on
with the protocol work while the child computes, and a model that crashes takes only its child down. What it
buys is that isolation, not speed: each batch costs two wake-ups across processes, and on the machines measured
(docs/serving.md, bench/results/serving.md) that cost more CPU than the compute it moved off the loop.

One child per model instance: ``instance_group { count: N }`` starts N children (on GPUs, N per card:
``serving/instances.py``, each child on its instance's card), each loading its own copy of
the model with the replica's thread budget divided among them (at least one thread each), and a batch goes to
the child with the fewest batches in hand, so that up to N batches compute at once in N processes (no
interpreter lock shared between them). N copies cost N times the model's memory.

Mechanism, not policy: :class:`ComputeProcess` is a :class:`~octacloud.serving.runtime.ModelRuntime` whose
batches run in the children. It adds ``run_async`` (the batcher awaits it on the loop: no thread, no futex; the
answer wakes the loop through the socket), ``pid``/``pids`` and ``resident_bytes`` (the first child's, for the
warm-up's bytes-per-sample measurement). Its blocking ``run`` serves the warm-up, before the loop owns the
sockets: every child computes the warm-up batches.

Wire: frames of a 4-byte little-endian length and a pickle (protocol 5) between a replica and the child it
started over a private socketpair; nothing else can reach that socket. Parent → child: ``("load", factory,
version_dir, config bytes, threads)`` once, then ``("run", inputs, output names)``; child → parent:
``("ok", value)`` or ``("error", type name, message, config error?)``, one answer per frame in order.

Failures: a load a child refuses raises :class:`ModelConfigError` with the child's message (and stops the
others). A child that dies (kill -9, a crash in native code) fails the batches it held with
:class:`ModelExecutionError` naming the exit status, while the other instances' children go on; the next batch
sent to its slot starts a new child, loads the model again and runs on it. The child exits when the
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
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy.typing as npt
from tritonclient.grpc import model_config_pb2 as mc

from octacloud.serving.compute_child import LENGTH, frame, read_frame
from octacloud.serving.errors import ModelConfigError, ModelExecutionError
from octacloud.serving.memory import resident_bytes
from octacloud.serving.runtime import Arrays, RuntimeFactory
from octacloud.serving.types import TensorMetadata

log = logging.getLogger("octacloud.serving.compute")

PARAM_COMPUTE = "compute"
"""Config parameter: where a model's batches are computed. "replica" (the default): in the replica's process;
"process": in a child process of the replica (:class:`ComputeProcess`)."""
COMPUTE_VALUES = ("replica", "process")

_CLOSE_WAIT_S = 5.0
_CHILD = "import sys; from octacloud.serving.compute_child import main; sys.exit(main(sys.argv[1:]))"


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
        while len(buffer) >= LENGTH.size:
            (n,) = LENGTH.unpack_from(buffer)
            end = LENGTH.size + n
            if len(buffer) < end:
                return
            message = pickle.loads(memoryview(buffer)[LENGTH.size : end])
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


class _Child:
    """One compute process: started and loaded (blocking), then driven from the loop through a :class:`_Link`;
    a dead one is replaced before its next batch."""

    def __init__(self, load: tuple[Any, ...], name: str) -> None:
        self.name = name
        self._load = load
        self.link: _Link | None = None
        self._preparing: asyncio.Task[None] | None = None
        self.closed = False
        self.restarts = 0
        self.in_hand = 0

    def spawn(self) -> None:
        """Start the process and send it the model to load (blocking; :meth:`loaded` reads the answer)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = subprocess.Popen(
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
        self.sock = ours
        try:
            ours.sendall(frame(self._load))
        except OSError:
            pass  # it died at once: loaded() names how

    def loaded(self) -> tuple[Any, ...]:
        """The child's description of the model it loaded; the child is stopped and the error raised if it
        could not load it."""
        error: OSError | None = None
        try:
            answer = read_frame(self.sock)
        except OSError as e:
            answer, error = None, e
        if answer is None or answer[0] != "ok":
            self.stop()
            if answer is None:
                raise ModelConfigError(
                    f"model {self.name!r}: its compute process exited while loading it "
                    f"({self.exit_words()}{f'; {error}' if error else ''})"
                )
            raise (ModelConfigError if answer[3] else ModelExecutionError)(answer[2])
        meta: tuple[Any, ...] = answer[1]
        return meta

    def exit_words(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "still running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit status {code}"

    def stop(self) -> None:
        self.hang_up()
        self.reap()

    def hang_up(self) -> None:
        """Close the replica's end: the child sees end of file and exits after its batch."""
        if self.link is not None and self.link.transport is not None:
            self.link.transport.close()
        self.sock.close()

    def reap(self) -> None:
        """Wait for the child to exit (a few seconds, then kill it)."""
        try:
            self.proc.wait(_CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def send(self, message: tuple[Any, ...]) -> None:
        """A frame on the blocking socket (before the loop owns it: load and warm-up)."""
        if self.link is not None:
            raise RuntimeError("the event loop owns the compute process: use run_async")
        try:
            self.sock.sendall(frame(message))
        except OSError:
            pass  # gone: answer() names how

    def answer(self) -> tuple[Any, ...]:
        try:
            answer = read_frame(self.sock)
        except OSError:
            answer = None
        if answer is None:
            raise ModelExecutionError(f"model {self.name!r}: its compute process is gone ({self.exit_words()})")
        return answer

    async def run_async(self, message: bytes) -> tuple[Any, ...]:
        """One batch's answer; :attr:`in_hand` counts it from the call (a batch waiting for the child to start
        is in this child's hands too)."""
        self.in_hand += 1
        try:
            link = self.link
            if link is None or not link.alive:
                link = await self._ready_link()
            future: asyncio.Future[tuple[Any, ...]] = asyncio.get_running_loop().create_future()
            link.pending.append(future)
            assert link.transport is not None
            link.transport.write(message)
            return await future
        finally:
            self.in_hand -= 1

    async def _ready_link(self) -> _Link:
        """The link to a live child: the socket handed to the loop on the first batch, a dead child replaced
        (one start for every batch waiting on it)."""
        if self.closed:
            raise ModelExecutionError(f"model {self.name!r}: its compute process is closed")
        if self._preparing is None:
            self._preparing = asyncio.get_running_loop().create_task(self._prepare())
        task = self._preparing
        try:
            await asyncio.shield(task)
        finally:
            if self._preparing is task and task.done():
                self._preparing = None
        link = self.link
        if self.closed or link is None:
            raise ModelExecutionError(f"model {self.name!r}: its compute process is closed")
        if not link.alive:
            raise ModelExecutionError(f"model {self.name!r}: its compute process stopped again as it started")
        return link

    async def _prepare(self) -> None:
        if self.link is not None and not self.link.alive:
            self.restarts += 1
            dead = self.proc
            try:
                await asyncio.to_thread(dead.wait, _CLOSE_WAIT_S)
            except subprocess.TimeoutExpired:
                dead.kill()
            log.warning("model %s: its compute process (pid %d) stopped (%s); starting another",
                        self.name, dead.pid, self.exit_words())  # fmt: skip
            self.link = None
            try:
                await asyncio.to_thread(self._restart)
            except Exception as e:
                raise ModelExecutionError(
                    f"model {self.name!r}: its compute process could not be restarted: {e}"
                ) from e
            if self.closed:  # closed while the new child loaded
                self.stop()
                return
        if self.link is None:
            self.sock.setblocking(False)
            _, self.link = await asyncio.get_running_loop().connect_accepted_socket(
                lambda: _Link(self._lost), sock=self.sock
            )

    def _restart(self) -> None:
        self.spawn()
        self.loaded()

    def _lost(self) -> ModelExecutionError:
        return ModelExecutionError(
            f"model {self.name!r}: its compute process (pid {self.proc.pid}) stopped during the batch; "
            "another is started for the next one"
        )


class ComputeProcess:
    """A model loaded and computed in child processes, one per model instance (``instance_group`` counts, as
    Triton's python backend starts a stub per instance), each with ``threads`` CPU threads. Blocking to create
    (it starts the children and waits until each has loaded the model): call it from a worker thread."""

    def __init__(
        self,
        factory: RuntimeFactory,
        version_dir: Path,
        config: mc.ModelConfig,
        threads: int,
        name: str = "",
        instances: int = 1,
        configs: Sequence[mc.ModelConfig] | None = None,
    ) -> None:
        self.name = name or version_dir.parent.name
        # Each instance's config: its own place's where the instances are on GPUs (serving/instances.py).
        each = list(configs) if configs else [config] * max(1, instances)
        self._children: list[_Child] = []
        try:
            for own in each:  # every child loads at once
                child = _Child(("load", factory, str(version_dir), own.SerializeToString(), threads), self.name)
                child.spawn()
                self._children.append(child)
            metas = [child.loaded() for child in self._children]
        except BaseException:
            for child in self._children:  # stopping one that already stopped is a no-op
                child.stop()
            raise
        inputs, outputs, device, couples = metas[0]
        self._inputs: tuple[TensorMetadata, ...] = inputs
        self._outputs: tuple[TensorMetadata, ...] = outputs
        self._device: str = device
        self.couples_rows: bool = couples

    @property
    def pid(self) -> int:
        """The first child's process id (:attr:`pids`: every child's)."""
        return self._children[0].proc.pid

    @property
    def pids(self) -> list[int]:
        return [child.proc.pid for child in self._children]

    @property
    def restarts(self) -> int:
        """Children started again after one stopped, all instances together."""
        return sum(child.restarts for child in self._children)

    def resident_bytes(self) -> int:
        """The first child's resident memory (one copy of the model: the warm-up measures bytes per sample
        there), 0 when it is gone."""
        return resident_bytes(self.pid)

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
        """One batch, blocking: the warm-up's path (batches on the loop go through :meth:`run_async`). Every
        child computes it, so that each instance is warm; the first child's answer is returned."""
        message = ("run", dict(inputs), tuple(outputs))
        for child in self._children:
            child.send(message)
        answers = [child.answer() for child in self._children]
        for answer in answers[1:]:
            self._result(answer)
        return self._result(answers[0])

    async def run_async(self, inputs: Arrays, outputs: Sequence[str]) -> dict[str, npt.NDArray[Any]]:
        """One batch on the child with the fewest batches in hand, awaited on the loop; a dead child is
        replaced first."""
        child = min(self._children, key=lambda c: c.in_hand)
        return self._result(await child.run_async(frame(("run", dict(inputs), tuple(outputs)))))

    def _result(self, answer: tuple[Any, ...]) -> dict[str, npt.NDArray[Any]]:
        if answer[0] == "ok":
            value: dict[str, npt.NDArray[Any]] = answer[1]
            return value
        raise ModelExecutionError(f"model {self.name!r} failed: {answer[1]}: {answer[2]}")

    def close(self) -> None:
        """Stop the children: each sees its socket close, frees the model and exits. Blocks until they have
        (at most a few seconds, then they are killed); called once the model has no batch left."""
        self._hang_up()
        self._reap()

    async def aclose(self) -> None:
        """:meth:`close` for a running loop: the sockets close on the loop, and the children (which may take a
        while to free a large model) are waited for in a thread, so that the loop goes on serving the
        replica's other models meanwhile."""
        self._hang_up()
        await asyncio.to_thread(self._reap)

    def _hang_up(self) -> None:
        for child in self._children:  # every child told first, so that they exit together
            child.closed = True
            child.hang_up()

    def _reap(self) -> None:
        for child in self._children:
            child.reap()
