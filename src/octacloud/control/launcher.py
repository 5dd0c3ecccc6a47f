"""Replica launch: a replica is an OIP server bound to its slice.

:class:`ReplicaLauncher` is the small interface the controller uses; :class:`LocalProcessLauncher` runs
replicas as local ``octacloud serve`` processes (one machine), and the Ray backend (``control/ray/``)
runs them as Ray actors on other machines. A launcher names each replica it started by an opaque *handle*
(a PID here, an actor name on Ray). Replicas outlive the controller, so a controller that restarts finds them
still serving and adopts them by handle.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from octacloud.control.slices import Slice
from octacloud.core.errors import InvalidSpecError, NotFoundError
from octacloud.security.internal_auth import REPLICA_ID_ENV
from octacloud.security.internal_tls import InternalCa, Renewals
from octacloud.storage.store import FsspecStore


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    replica_id: str
    serve_as: str
    """The model name clients use (the deployment's name)."""
    model_dir: Path
    """``<repository>/<model>``: the model's folder in the repository."""
    version: str
    env: dict[str, str]
    threads: int
    slice: Slice | None = None
    """Where the scheduler placed it (node, cards, milli per card): remote launchers pin the replica there."""


@dataclass(frozen=True, slots=True)
class ReplicaAddress:
    """Where a replica serves: its host and ports, and (for operators) its process id on that host."""

    host: str
    http_port: int
    grpc_port: int
    metrics_port: int
    pid: int | None = None
    note: str = ""
    """What the launcher wants recorded about the start (e.g. a model-cache hit or miss); may be empty."""


@dataclass(frozen=True, slots=True)
class Launched:
    handle: str
    """The launcher's name for the replica: what ``alive``, ``address`` and ``stop`` take."""
    address: ReplicaAddress | None
    """Known at once for local processes; None while a remote replica is still starting (ask ``address``)."""
    log: Path | None = None


class LaunchFailedError(RuntimeError):
    """A launched replica could not start (its model would not load, its node refused it, ...)."""


class ReplicaLauncher(Protocol):
    """Starts and stops replicas.

    ``launch`` returns once the replica exists (not once it is ready: the controller probes readiness) and
    never waits for a remote machine. ``address`` returns where a launched replica serves once that is known,
    None while it is still starting, and raises :class:`LaunchFailedError` when its start failed; it never
    blocks. ``alive`` is cheap and never blocks. ``stop`` sends a graceful stop, waits up to ``grace``
    seconds, then kills, and is a no-op for a replica that is already gone. Handles are strings the store
    keeps, so that a restarted controller can ask about replicas an earlier one launched.
    """

    def launch(self, spec: LaunchSpec) -> Launched: ...

    def address(self, handle: str) -> ReplicaAddress | None: ...

    def alive(self, handle: str) -> bool: ...

    def stop(self, handle: str, grace: float = 5.0) -> None: ...

    def handles(self) -> list[str] | None:
        """The handles of every replica of this cloud that runs now, found on the machines themselves (not from
        what this launcher remembers), or None where the launcher cannot tell its cloud's replicas from others'.
        A restarted controller stops those its store does not know: a replica launched the moment before a
        ``kill -9``, whose handle the store never received."""
        ...


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now (another process may take it before it is used: the launcher hands bound sockets
    instead, :func:`held_port`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


INHERITED_FDS = (3, 4, 5)
"""Where a replica finds its REST, gRPC and metrics sockets (``octacloud serve --http-fd 3 --grpc-fd 4
--metrics-fd 5``)."""


def held_port(host: str) -> socket.socket:
    """A TCP socket bound to a free port of ``host``, not listening (connections are refused until the replica
    listens on it), at a file descriptor above :data:`INHERITED_FDS` and closed on exec: the port is held from
    now until the replica that inherits it exits, so no other process can take it in between."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.bind((host, 0))  # no SO_REUSEADDR: with it, another socket that sets it too could bind the same port
        if sock.fileno() <= max(INHERITED_FDS):  # a spawn's dup2 onto 3-5 must never overwrite another source
            moved = socket.socket(fileno=fcntl.fcntl(sock.fileno(), fcntl.F_DUPFD_CLOEXEC, 10))
            sock.close()
            sock = moved
    except BaseException:
        sock.close()
        raise
    return sock


def check_version(model_dir: Path, version: str) -> None:
    """Raise unless ``version`` ('' = the model's own policy) names a version folder of ``model_dir``."""
    if not version:
        return
    present = sorted((p.name for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=int)
    if not version.isdigit():
        raise InvalidSpecError(f"version must be a whole number (a version folder), got {version!r}")
    if str(int(version)) not in present:
        raise NotFoundError(
            f"model {model_dir.name!r} has no version {version} (its versions: {', '.join(present) or 'none'})"
        )


def model_view(spec: LaunchSpec, root: Path, versions: Sequence[int] | None = None) -> Path:
    """A one-model repository under ``root`` that serves ``spec.model_dir`` as ``spec.serve_as``.

    Version folders are symlinked (no copy of the weights); ``config.pbtxt`` is rewritten with its ``name``
    set to ``serve_as``, since Triton's layout requires the folder and the configured name to agree. A
    deployment pinned to a version (``spec.version``) links only that version's folder and sets the
    config's ``version_policy`` to ``specific { versions: [N] }``, so exactly that version is served, also
    after the repository gains a newer one. Without a version the model's own policy applies (the latest).
    ``versions``: link only these (a node cache's folder may hold versions other replicas serve).
    """
    if not spec.model_dir.is_dir():
        raise NotFoundError(f"model folder {spec.model_dir} does not exist")
    check_version(spec.model_dir, spec.version)
    pinned = str(int(spec.version)) if spec.version else None
    repo = root / "repository"
    target = repo / spec.serve_as
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    config = mc.ModelConfig()
    for entry in sorted(spec.model_dir.iterdir()):
        if entry.is_dir() and entry.name.isdigit():
            chosen = versions is None or int(entry.name) in versions
            if chosen and (pinned is None or str(int(entry.name)) == pinned):
                (target / entry.name).symlink_to(entry.resolve(), target_is_directory=True)
        elif entry.name == "config.pbtxt":
            try:
                text_format.Parse(entry.read_text(), config)
            except text_format.ParseError as exc:
                raise InvalidSpecError(f"{entry}: {exc}") from None
        elif entry.is_file():
            (target / entry.name).symlink_to(entry.resolve())
    config.name = spec.serve_as
    if pinned is not None:
        config.version_policy.specific.versions[:] = [int(pinned)]
    (target / "config.pbtxt").write_text(text_format.MessageToString(config))
    return repo


@dataclass(frozen=True, slots=True)
class StoreFetch:
    """Replicas fetch their model from a model store into this node's cache before they load it."""

    store: FsspecStore
    cache_root: Path
    limit_bytes: int | None = None
    credentials: Path | None = None
    """The S3 credentials file the store was opened with (the replica opens it again)."""

    def argv(self, spec: LaunchSpec) -> list[str]:
        args = [
            "--model-storage",
            self.store.url,
            "--model-cache",
            str(self.cache_root),
            "--fetch-model",
            spec.model_dir.name,
            "--fetch-version",
            spec.version,
            "--serve-as",
            spec.serve_as,
        ]
        if self.limit_bytes is not None:
            args += ["--model-cache-size", str(self.limit_bytes)]
        if self.credentials is not None:
            args += ["--storage-credentials", str(self.credentials)]
        return args  # fmt: skip


class LocalProcessLauncher:
    """Replicas as local ``octacloud serve`` processes, one per slice. With ``fetch``, each replica fetches its
    model from the model store into the node cache itself (one download however many start at once), then
    loads it; without, it serves the model's folder in the local repository."""

    def __init__(
        self,
        workdir: Path,
        host: str = "127.0.0.1",
        python: str = sys.executable,
        environment: Callable[[], Mapping[str, str]] | None = None,
        internal_ca: InternalCa | None = None,
        fetch: StoreFetch | None = None,
    ) -> None:
        self.fetch = fetch
        self._logs: dict[str, Path] = {}
        self._prefetch_lock = threading.Lock()
        self._prefetching: set[str] = set()
        self.prefetched: list[tuple[str, str]] = []
        """(node, model) of every prefetch that completed, in order."""
        self.internal_ca = internal_ca
        """Internal TLS: each replica gets a fresh certificate of this CA (files in its folder, key mode 0600)."""
        self._renewals = Renewals(internal_ca) if internal_ca is not None else None
        self.workdir = workdir
        self.host = host
        """Where replicas listen: loopback, since the gateway runs on this machine."""
        self.python = python
        self.environment = environment
        """The node's environment for every replica it starts (e.g. its MPS daemon's pipe folder), asked at each
        launch; the slice's own variables come after it."""
        self._addresses: dict[str, ReplicaAddress] = {}

    def launch(self, spec: LaunchSpec) -> Launched:
        root = self.workdir / spec.replica_id
        root.mkdir(parents=True, exist_ok=True)
        # fetched: the replica makes its view once its model is in the node cache
        repo = root.resolve() / "repository" if self.fetch is not None else model_view(spec, root.resolve())
        # The ports are bound here and the sockets handed to the replica (REST, gRPC, metrics at file descriptors
        # 3, 4, 5): a port picked and released for the replica to bind could be taken meanwhile by anything,
        # another replica being launched at the same moment among them.
        held: list[socket.socket] = []
        try:
            held = [held_port(self.host) for _ in INHERITED_FDS]
            return self._spawn(spec, root, repo, held)
        finally:
            for sock in held:
                sock.close()  # the replica has its own copies now

    def _spawn(self, spec: LaunchSpec, root: Path, repo: Path, held: list[socket.socket]) -> Launched:
        argv = [
            self.python, "-m", "octacloud", "serve",
            "--repository", str(repo),
            "--model-control-mode", "explicit",
            "--load-model", spec.serve_as,
            "--host", self.host,
            "--http-fd", str(INHERITED_FDS[0]),
            "--grpc-fd", str(INHERITED_FDS[1]),
            "--metrics-fd", str(INHERITED_FDS[2]),
            "--threads", str(spec.threads),
            *(self.fetch.argv(spec) if self.fetch is not None else []),
        ]  # fmt: skip
        node_env = self.environment() if self.environment is not None else {}
        env = {**os.environ, **node_env, **spec.env, REPLICA_ID_ENV: spec.replica_id, "PYTHONUNBUFFERED": "1"}
        if self._renewals is not None:
            env.update(self._renewals.issue(spec.replica_id, [self.host]).write(root, "replica").env())
        log = root / "replica.log"
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        # stdin, stdout and stderr first: a socket's dup2 onto 3-5 may then overwrite the log's own descriptor
        sockets = [(os.POSIX_SPAWN_DUP2, s.fileno(), target) for s, target in zip(held, INHERITED_FDS, strict=True)]
        try:
            # posix_spawn in a new session: the replica survives a controller restart and is stopped by PID.
            # No Popen object is kept, so a controller that exits leaves no half-owned child behind.
            pid = os.posix_spawn(
                argv[0],
                argv,
                env,
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_DUP2, fd, 1),
                    (os.POSIX_SPAWN_DUP2, fd, 2),
                    *sockets,
                ],
                setsid=True,
            )
        finally:
            os.close(fd)
        http, grpc, metrics = (int(sock.getsockname()[1]) for sock in held)
        self._addresses[str(pid)] = ReplicaAddress(self.host, http, grpc, metrics, pid)
        self._logs[str(pid)] = log
        if self._renewals is not None:
            self._renewals.track(str(pid), spec.replica_id, [self.host])
        return Launched(str(pid), self._addresses[str(pid)], log)

    def prefetch(self, node: str, model: str, version: str) -> None:
        """Fetch what a replica of ``model`` (``version``: '' for its policy) needs into this machine's node
        cache now, in the background, ahead of a replica that will start here (one waiting for its slice, a
        warm copy for the failover reserve). Never blocks; a prefetch already under way is not repeated."""
        if self.fetch is None:
            return
        key = f"{model}@{version}"
        with self._prefetch_lock:
            if key in self._prefetching:
                return
            self._prefetching.add(key)
        threading.Thread(target=self._prefetch, args=(node, model, version, key), daemon=True).start()

    def _prefetch(self, node: str, model: str, version: str, key: str) -> None:
        from octacloud.control.models import fetch_model
        from octacloud.storage.cache import NodeCache

        fetch = self.fetch
        assert fetch is not None
        try:
            got = fetch_model(NodeCache(fetch.cache_root, fetch.limit_bytes), fetch.store, model, version)
            logging.getLogger("octacloud.storage").info("prefetch: %s", got.describe(node))
            self.prefetched.append((node, model))
        except Exception as exc:  # a prefetch is an optimisation: the replica fetches (and reports) itself
            logging.getLogger("octacloud.storage").warning("prefetch of %s on %s failed: %s", key, node, exc)
        finally:
            with self._prefetch_lock:
                self._prefetching.discard(key)

    def exit_reason(self, handle: str) -> str:
        """Why a replica that exited did (the error its last lines report: a model store that did not answer, a
        full node cache), or '' when it did not say."""
        log = self._logs.get(handle)
        try:
            with log.open("rb") as f:  # type: ignore[union-attr]
                f.seek(max(0, log.stat().st_size - 8192))  # type: ignore[union-attr]
                tail = f.read().decode("utf-8", "replace").splitlines()
        except (AttributeError, OSError):
            return ""
        said = [line.removeprefix("octacloud serve: ") for line in tail if line.startswith("octacloud serve: ")]
        return said[-1][:500] if said else ""

    def address(self, handle: str) -> ReplicaAddress | None:
        """Known from launch; an adopted replica's address is in the store, so None here means "ask the store"."""
        return self._addresses.get(handle)

    def alive(self, handle: str) -> bool:
        pid = _pid(handle)
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)  # reaps our own children once they exit
        except ChildProcessError:
            return _pid_alive(pid)  # not our child (adopted after a controller restart)
        return done == 0

    def adopt_certificate(self, handle: str, replica_id: str, host: str) -> None:
        """A replica an earlier controller started: renew its certificate from now on (the next renewal first)."""
        if self._renewals is not None:
            self._renewals.adopt(handle, replica_id, [host])

    def renew_certificates(self) -> int:
        """Hand a new certificate to each running replica whose certificate is past half its life (it loads it
        for its next handshakes); returns how many were renewed."""
        if self._renewals is None:
            return 0
        renewed = 0
        for handle, replica_id, credentials in self._renewals.due():
            if self.alive(handle):
                credentials.write(self.workdir / replica_id, "replica")
                renewed += 1
        return renewed

    def handles(self) -> list[str]:
        """PIDs of the live ``octacloud serve`` processes whose repository is under this launcher's folder."""
        root = str(self.workdir.resolve()).encode() + b"/"
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue  # gone meanwhile, or not ours to read
            if state != "Z" and b"serve" in argv[2:4] and any(a.startswith(root) for a in argv):
                found.append(entry)
        return found

    def stop(self, handle: str, grace: float = 5.0) -> None:
        self._addresses.pop(handle, None)
        self._logs.pop(handle, None)
        if self._renewals is not None:
            self._renewals.forget(handle)
        if not self.alive(handle):
            return
        pid = _pid(handle)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not self.alive(handle):
                return
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while self.alive(handle) and time.monotonic() < deadline:
            time.sleep(0.02)


def _pid(handle: str) -> int:
    if not handle.isdigit():
        raise InvalidSpecError(f"{handle!r} is not a local replica handle (a PID); was it launched on Ray?")
    return int(handle)


def _pid_alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie (works for processes that are not our children)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"
