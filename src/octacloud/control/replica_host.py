"""A replica host: one process that serves many emulated replicas, each a real OIP endpoint of its own.

:class:`~octacloud.control.emulated.EmulatedLauncher` starts a few of these (``python -m
octacloud.control.replica_host --socket PATH``) and asks them over a Unix socket, one JSON line per request and
one per answer:

* ``{"op": "launch", "replica_id", "serve_as", "model_dir", "version", "env", "threads", "root"}`` →
  ``{"ok": true, "http_port", "grpc_port", "metrics_port", "pid"}`` once its ports are bound;
* ``{"op": "stop", "replica_id", "grace"}`` → ``{"ok": true}`` once it has finished what it had in flight (up to
  ``grace`` s) and closed;
* ``{"op": "crash", "replica_ids"}`` → ``{"ok": true}``: the replicas are gone at once, with no answer to what they
  had in flight (a lost node);
* ``{"op": "list"}`` → ``{"ok": true, "replicas": [...], "pid"}``: the replicas that serve or are starting.
A request that fails is answered ``{"ok": false, "error": "..."}``.

Each replica is a :class:`~octacloud.protocols.server.ReplicaServer` (REST, gRPC, metrics on the event loop,
health, the internal secret and the replica id checks, internal TLS when the launcher gives it files) over the
:mod:`emulated runtime <octacloud.serving.emulated>`: the same answers as a real replica, with no model compute.
Its ports are bound before ``launch`` answers, so the controller knows its address at once, and its model loads
behind (after ``--load-ms``, as a real model takes a while). A host outlives the controller that started it
(its own session), as replica processes do, and exits once it has served no replica for ``--idle-exit-s``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from octacloud.control.launcher import LaunchSpec, held_port, model_view
from octacloud.protocols.internal import ENV_VAR, TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV, ReplicaTls
from octacloud.protocols.server import ReplicaServer, ServerSettings, new_event_loop
from octacloud.serving import ControlMode
from octacloud.serving.emulated import EmulatedLatency, emulated_runtimes

log = logging.getLogger("octacloud.replica_host")

MAX_LINE = 1 << 20


@dataclass(slots=True)
class _Hosted:
    server: ReplicaServer
    held: list[socket.socket]
    """The ports, bound here before ``launch`` answers, until the server listens on its copies (``handed``)."""
    handed: list[int]
    task: asyncio.Task[None] | None = None
    """The model's load and the start behind ``launch``'s answer."""


class ReplicaHost:
    """The replicas of one host process, on its event loop."""

    def __init__(self, latency: EmulatedLatency, load_s: float = 0.0, idle_exit_s: float = 60.0) -> None:
        self.latency = latency
        self.load_s = load_s
        self.idle_exit_s = idle_exit_s
        self.replicas: dict[str, _Hosted] = {}
        self.done = asyncio.Event()
        self._idle_since = asyncio.get_running_loop().time()

    # ---- requests ----------------------------------------------------------------------------------------

    async def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "list":
            return {"ok": True, "replicas": sorted(self.replicas), "pid": os.getpid()}
        if op == "launch":
            return self.launch(request)
        if op == "stop":
            await self.stop(str(request["replica_id"]), float(request.get("grace", 5.0)))
            return {"ok": True}
        if op == "crash":
            for replica_id in request.get("replica_ids", []):
                await self.stop(str(replica_id), 0.0)
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r} (launch, stop, crash or list)"}

    def launch(self, request: dict[str, Any]) -> dict[str, Any]:
        spec = LaunchSpec(
            replica_id=str(request["replica_id"]),
            serve_as=str(request["serve_as"]),
            model_dir=Path(request["model_dir"]),
            version=str(request.get("version", "")),
            env={str(k): str(v) for k, v in dict(request.get("env", {})).items()},
            threads=int(request.get("threads", 1)),
        )
        if spec.replica_id in self.replicas:
            return {"ok": False, "error": f"replica {spec.replica_id} runs on this host already"}
        root = Path(request["root"])
        root.mkdir(parents=True, exist_ok=True)
        repo = model_view(spec, root.resolve())
        held = [held_port("127.0.0.1") for _ in range(3)]
        handed = [os.dup(sock.fileno()) for sock in held]  # the server's; ``held`` keeps the ports until it listens
        settings = ServerSettings(
            repository=repo,
            http_fd=handed[0],
            grpc_fd=handed[1],
            metrics_fd=handed[2],
            control_mode=ControlMode.EXPLICIT,
            load_models=[spec.serve_as],
            threads=spec.threads,
            runtimes=emulated_runtimes(self.latency),
            internal_secret_file=Path(spec.env[ENV_VAR]) if spec.env.get(ENV_VAR) else None,
            replica_id=spec.replica_id,
            tls=_tls(spec.env),
            metrics_on_loop=True,
        )
        hosted = _Hosted(ReplicaServer(settings), held, handed)
        self.replicas[spec.replica_id] = hosted
        hosted.task = asyncio.get_running_loop().create_task(self._start(spec.replica_id, hosted))
        http, grpc, metrics = (int(sock.getsockname()[1]) for sock in held)
        return {"ok": True, "http_port": http, "grpc_port": grpc, "metrics_port": metrics, "pid": os.getpid()}

    async def _start(self, replica_id: str, hosted: _Hosted) -> None:
        try:
            if self.load_s:
                await asyncio.sleep(self.load_s)
            await hosted.server.start()
        except BaseException as exc:
            if hosted.server.http_port is None:  # failed before it took any of its sockets: they are ours to close
                for fd in hosted.handed:
                    os.close(fd)
            if not isinstance(exc, asyncio.CancelledError):  # a model that would not load: the replica is gone
                log.exception("replica %s failed to start", replica_id)
                if self.replicas.get(replica_id) is hosted:
                    del self.replicas[replica_id]
            if isinstance(exc, Exception):
                return
            raise
        finally:
            for sock in hosted.held:
                sock.close()  # listening on its copy now (or never)

    async def stop(self, replica_id: str, grace: float) -> None:
        hosted = self.replicas.pop(replica_id, None)
        if hosted is None:
            return
        if hosted.task is not None and not hosted.task.done():
            hosted.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await hosted.task
        s = hosted.server.settings
        s.http_grace_s = s.grpc_grace_s = grace
        try:
            await hosted.server.stop()
        except Exception:
            log.exception("replica %s: stopping failed", replica_id)
        if not self.replicas:
            self._idle_since = asyncio.get_running_loop().time()

    async def stop_all(self) -> None:
        await asyncio.gather(*(self.stop(r, 5.0) for r in list(self.replicas)))

    async def watch_idle(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.done.is_set():
            await asyncio.sleep(min(1.0, self.idle_exit_s))
            if not self.replicas and loop.time() - self._idle_since >= self.idle_exit_s:
                self.done.set()

    # ---- the socket --------------------------------------------------------------------------------------

    async def serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                try:
                    request = json.loads(line)
                    if not isinstance(request, dict):
                        raise ValueError("a request is a JSON object")
                    answer = await self.handle(request)
                except Exception as exc:  # a bad request is answered, never fatal to the host
                    answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                writer.write(json.dumps(answer).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()


def _tls(env: dict[str, str]) -> ReplicaTls | None:
    values = [env.get(name) for name in (TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV)]
    return ReplicaTls(*(Path(v) for v in values if v)) if all(values) else None


async def serve(path: Path, host: ReplicaHost) -> None:
    path.unlink(missing_ok=True)
    server = await asyncio.start_unix_server(host.serve_connection, path=str(path), limit=MAX_LINE)
    os.chmod(path, 0o600)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, host.done.set)
    watcher = loop.create_task(host.watch_idle())
    try:
        await host.done.wait()
    finally:
        watcher.cancel()
        server.close()
        path.unlink(missing_ok=True)
        await host.stop_all()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m octacloud.control.replica_host", description=__doc__)
    parser.add_argument("--socket", type=Path, required=True, help="The Unix socket to answer requests on.")
    parser.add_argument("--latency-ms", type=float, default=2.0, help="Each batch's fixed latency.")
    parser.add_argument("--per-row-ms", type=float, default=0.0, help="Each batch's latency per row.")
    parser.add_argument("--load-ms", type=float, default=0.0, help="How long a replica's model takes to load.")
    parser.add_argument("--idle-exit-s", type=float, default=60.0, help="Exit after serving no replica this long.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def run() -> None:
        host = ReplicaHost(EmulatedLatency(args.latency_ms, args.per_row_ms), args.load_ms / 1000, args.idle_exit_s)
        await serve(args.socket, host)

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(run())


if __name__ == "__main__":
    main()
