"""The emulated fleet's launcher: many lightweight replicas per process, so that the live cloud — controller,
store, gateway, meter and dashboard, all the real ones — runs at the size of a thousand-card fleet here.

:class:`EmulatedLauncher` is a :class:`~octacloud.control.launcher.ReplicaLauncher`. It keeps ``hosts`` replica
host processes (:mod:`octacloud.control.replica_host`, started on first use in a session of their own, so that
they outlive the controller as replica processes do) and puts each node's replicas on one of them (the node's
name picks it), so a node's replicas live and die together. Every replica is a real OIP endpoint on its own
ports — REST, gRPC, metrics, health, the internal secret — whose model answers after a configurable latency
and computes nothing (:mod:`octacloud.serving.emulated`).

A handle is ``emu:<host>:<replica id>``; a restarted controller finds the hosts again by their sockets under
``workdir/hosts`` and adopts their replicas. ``alive`` reads a listing of the host that is at most
``list_every_s`` old (one request per host, not one per replica); :meth:`EmulatedLauncher.refresh` fetches them
all, which the controller does off its event loop before each health check. :meth:`EmulatedLauncher.crash_node` ends a
node's replicas at once, without answers to what they had in flight: what a lost node does.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from octacloud.control.launcher import Launched, LaunchFailedError, LaunchSpec, ReplicaAddress
from octacloud.core.errors import InvalidSpecError
from octacloud.security.internal_auth import REPLICA_ID_ENV
from octacloud.security.internal_tls import InternalCa, Renewals
from octacloud.serving.emulated import EmulatedLatency

PREFIX = "emu:"
HOSTS_FOLDER = "hosts"
START_TIMEOUT_S = 30.0


@dataclass(slots=True)
class _Listing:
    at: float = 0.0
    replicas: frozenset[str] = frozenset()
    up: bool = False
    pid: int | None = None


@dataclass(frozen=True, slots=True)
class EmulationSettings:
    """How an emulated fleet behaves: the replicas' latency, how long a model takes to load, how many hosts."""

    latency: EmulatedLatency = field(default_factory=EmulatedLatency)
    load_ms: float = 0.0
    hosts: int = 4
    idle_exit_s: float = 60.0

    def __post_init__(self) -> None:
        if self.hosts < 1:
            raise InvalidSpecError(f"an emulated fleet needs at least 1 replica host process, got {self.hosts}")
        if not self.load_ms >= 0:
            raise InvalidSpecError(f"an emulated model's load time must be ≥ 0 ms, got {self.load_ms!r}")


def handle_of(host: str, replica_id: str) -> str:
    return f"{PREFIX}{host}:{replica_id}"


def parse_handle(handle: str) -> tuple[str, str]:
    """``(host, replica id)`` of an emulated replica's handle."""
    if not handle.startswith(PREFIX) or handle.count(":") < 2:
        raise InvalidSpecError(f"{handle!r} is not an emulated replica's handle (emu:<host>:<replica>)")
    host, _, replica_id = handle[len(PREFIX) :].partition(":")
    return host, replica_id


def is_emulated(handle: str) -> bool:
    return handle.startswith(PREFIX)


class EmulatedLauncher:
    """Replicas as emulated OIP endpoints inside a few replica host processes (see the module)."""

    def __init__(
        self,
        workdir: Path,
        settings: EmulationSettings | None = None,
        *,
        python: str = sys.executable,
        environment: Callable[[], Mapping[str, str]] | None = None,
        internal_ca: InternalCa | None = None,
        list_every_s: float = 0.25,
    ) -> None:
        self.workdir = workdir
        self.settings = settings or EmulationSettings()
        self.python = python
        self.environment = environment
        self.internal_ca = internal_ca
        self._renewals = Renewals(internal_ca) if internal_ca is not None else None
        self.list_every_s = list_every_s
        self._addresses: dict[str, ReplicaAddress] = {}
        self._listings: dict[str, _Listing] = {}
        self._launched: dict[str, set[str]] = {}
        """Replicas launched since the host's last listing (the listing may predate them)."""
        self._lock = threading.Lock()
        self._starting: dict[str, threading.Lock] = {}

    # ---- hosts -------------------------------------------------------------------------------------------

    def host_of(self, node: str) -> str:
        """The host process that runs ``node``'s replicas."""
        return f"h{zlib.crc32(node.encode()) % self.settings.hosts}"

    def _socket(self, host: str) -> Path:
        return self.workdir / HOSTS_FOLDER / f"{host}.sock"

    def _ask(self, host: str, request: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(self._socket(host)))
            s.sendall(json.dumps(request).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    raise ConnectionError(f"replica host {host} closed the connection")
                data += chunk
        answer: dict[str, Any] = json.loads(data)
        return answer

    def _ensure_host(self, host: str) -> None:
        """Start ``host`` unless it answers already (one start at a time per host)."""
        with self._lock:
            gate = self._starting.setdefault(host, threading.Lock())
        with gate:
            try:
                self._ask(host, {"op": "list"}, timeout=5.0)
                return
            except (OSError, ValueError):
                pass
            path = self._socket(host)
            path.parent.mkdir(parents=True, exist_ok=True)
            s = self.settings
            argv = [
                self.python, "-m", "octacloud.control.replica_host", "--socket", str(path),
                "--latency-ms", repr(s.latency.fixed_ms), "--per-row-ms", repr(s.latency.per_row_ms),
                "--load-ms", repr(s.load_ms), "--idle-exit-s", repr(s.idle_exit_s),
            ]  # fmt: skip
            log = os.open(path.with_suffix(".log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.posix_spawn(
                    argv[0], argv, dict(os.environ),
                    file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                                  (os.POSIX_SPAWN_DUP2, log, 1), (os.POSIX_SPAWN_DUP2, log, 2)],
                    setsid=True,
                )  # fmt: skip
            finally:
                os.close(log)
            deadline = time.monotonic() + START_TIMEOUT_S
            while time.monotonic() < deadline:
                try:
                    self._ask(host, {"op": "list"}, timeout=5.0)
                    return
                except (OSError, ValueError):
                    time.sleep(0.05)
            raise LaunchFailedError(
                f"replica host {host} did not start within {START_TIMEOUT_S:g} s (see {path.with_suffix('.log')})"
            )

    def _listing(self, host: str, ask: bool = False) -> _Listing:
        """What ``host`` serves, as listed at most ``list_every_s`` ago (``ask``: asked now)."""
        now = time.monotonic()
        with self._lock:
            known = self._listings.get(host)
        if known is not None and now - known.at < self.list_every_s and not ask:
            return known
        try:
            answer = self._ask(host, {"op": "list"}, timeout=1.0)
            fresh = _Listing(now, frozenset(answer.get("replicas", [])), True, answer.get("pid"))
        except FileNotFoundError:
            fresh = _Listing(now)
        except ConnectionRefusedError:
            fresh = _Listing(now)
        except (OSError, ValueError):  # slow to answer: what was known stands a little longer
            return known or _Listing(now, up=True)
        with self._lock:
            self._listings[host] = fresh
            self._launched.pop(host, None)
        return fresh

    # ---- the launcher's interface ------------------------------------------------------------------------

    def launch(self, spec: LaunchSpec) -> Launched:
        if spec.slice is None:
            raise LaunchFailedError(f"replica {spec.replica_id}: an emulated replica needs its slice (its node)")
        host = self.host_of(spec.slice.node)
        self._ensure_host(host)
        root = self.workdir / spec.replica_id
        env = {**(self.environment() if self.environment is not None else {}), **spec.env,
               REPLICA_ID_ENV: spec.replica_id}  # fmt: skip
        if self._renewals is not None:
            root.mkdir(parents=True, exist_ok=True)
            env.update(self._renewals.issue(spec.replica_id, ["127.0.0.1"]).write(root, "replica").env())
        request = {
            "op": "launch", "replica_id": spec.replica_id, "serve_as": spec.serve_as,
            "model_dir": str(spec.model_dir.resolve()), "version": spec.version, "env": env,
            "threads": spec.threads, "root": str(root.resolve()),
        }  # fmt: skip
        try:
            answer = self._ask(host, request)
        except (OSError, ValueError) as exc:
            raise LaunchFailedError(f"replica host {host} did not take replica {spec.replica_id}: {exc}") from None
        if not answer.get("ok"):
            raise LaunchFailedError(f"replica {spec.replica_id}: {answer.get('error', 'refused')}")
        handle = handle_of(host, spec.replica_id)
        address = ReplicaAddress(
            "127.0.0.1", int(answer["http_port"]), int(answer["grpc_port"]), int(answer["metrics_port"]),
            int(answer["pid"]),
        )  # fmt: skip
        with self._lock:
            self._addresses[handle] = address
            self._launched.setdefault(host, set()).add(spec.replica_id)
        if self._renewals is not None:
            self._renewals.track(handle, spec.replica_id, ["127.0.0.1"])
        return Launched(handle, address, self._socket(host).with_suffix(".log"))

    def address(self, handle: str) -> ReplicaAddress | None:
        return self._addresses.get(handle)

    def refresh(self) -> None:
        """List every host now (blocking: the controller calls it in a thread before a health check, so that the
        check's ``alive`` calls read these listings instead of asking busy hosts from the event loop)."""
        folder = self.workdir / HOSTS_FOLDER
        for path in sorted(folder.glob("*.sock")) if folder.is_dir() else []:
            self._listing(path.stem, ask=True)

    def alive(self, handle: str) -> bool:
        host, replica_id = parse_handle(handle)
        listing = self._listing(host)
        with self._lock:
            just_launched = replica_id in self._launched.get(host, ())
        return listing.up and (replica_id in listing.replicas or just_launched)

    def stop(self, handle: str, grace: float = 5.0) -> None:
        host, replica_id = parse_handle(handle)
        with self._lock:
            self._addresses.pop(handle, None)
            self._launched.get(host, set()).discard(replica_id)
            self._listings.pop(host, None)
        if self._renewals is not None:
            self._renewals.forget(handle)
        with contextlib.suppress(OSError, ValueError):  # a host that is gone took its replicas with it
            self._ask(host, {"op": "stop", "replica_id": replica_id, "grace": grace}, timeout=grace + 10.0)

    def handles(self) -> list[str]:
        """Every replica the hosts under this launcher's folder serve now."""
        folder = self.workdir / HOSTS_FOLDER
        found: list[str] = []
        for path in sorted(folder.glob("*.sock")) if folder.is_dir() else []:
            listing = self._listing(path.stem)
            found.extend(handle_of(path.stem, r) for r in sorted(listing.replicas))
        return found

    # ---- failures, for the benchmarks and tests ----------------------------------------------------------

    def crash_node(self, node: str, replica_ids: list[str]) -> None:
        """End ``replica_ids`` (the replicas of ``node``) at once, as a node that is lost ends them."""
        host = self.host_of(node)
        with self._lock:
            self._listings.pop(host, None)
            for r in replica_ids:
                self._launched.get(host, set()).discard(r)
        with contextlib.suppress(OSError, ValueError):
            self._ask(host, {"op": "crash", "replica_ids": replica_ids})

    def host_pids(self) -> dict[str, int]:
        """The process id of every host that answers (for the benchmark's memory figures)."""
        folder = self.workdir / HOSTS_FOLDER
        pids = {}
        for path in sorted(folder.glob("*.sock")) if folder.is_dir() else []:
            listing = self._listing(path.stem)
            if listing.up and listing.pid is not None:
                pids[path.stem] = listing.pid
        return pids

    def stop_hosts(self) -> None:
        """Stop every host process (and so every replica it serves): ``octacloud down``'s last step."""
        for host, pid in self.host_pids().items():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 15)
            self._listings.pop(host, None)


__all__ = [
    "EmulatedLauncher",
    "EmulationSettings",
    "handle_of",
    "is_emulated",
    "parse_handle",
]
