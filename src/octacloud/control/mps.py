"""CUDA MPS, managed: one MPS control daemon per GPU node, started, watched and stopped with the cloud.

A replica on a share of a card is confined by CUDA MPS: its process environment carries its active-thread
percentage and pinned-memory limit (:func:`octacloud.control.slices.slice_environment`), and those variables
mean something only to an MPS server. :class:`MpsDaemon` owns that server's control daemon on one node:

* :meth:`MpsDaemon.start` runs ``nvidia-cuda-mps-control -d`` with its pipe and log folders under the cloud's
  state directory (not the machine-wide ``/tmp/nvidia-mps``, so two clouds or a user's own MPS never collide),
  and, where the driver allows it, puts the node's cards into ``EXCLUSIVE_PROCESS`` compute mode, so that only
  the MPS server (and through it, every replica) opens a context on them. The previous modes come back at stop.
* :meth:`MpsDaemon.environment` is what every GPU replica of the node gets (``CUDA_MPS_PIPE_DIRECTORY``,
  ``CUDA_MPS_LOG_DIRECTORY``): the replicas' MPS clients find this daemon and no other.
* :meth:`MpsDaemon.check` asks the daemon for its servers (``get_server_list``). A daemon that no longer answers
  is restarted; a server that vanished (it crashed, taking its clients' contexts with it) is reported, so that the
  controller restarts the replicas on those cards. Both come back as a :class:`MpsCheck`.
* :meth:`MpsDaemon.stop` sends ``quit`` and waits for the daemon to go.

Where MPS is not available (the binary is missing, the daemon does not start) the node falls back to CUDA's
default time-slicing: :attr:`MpsDaemon.mode` says ``time-slicing`` and :attr:`MpsDaemon.reason` why; replicas
still hold their memory budget inside the process (the CUDA arena limit), but compute shares are not enforced.

The commands run through a :class:`CommandRunner` and compute modes through a :class:`ComputeModes`, so the
daemon is tested against a fake ``nvidia-cuda-mps-control`` script and the fake NVML.
"""

from __future__ import annotations

import enum
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("octacloud.mps")

CONTROL_BINARY = "nvidia-cuda-mps-control"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"


class SharingMode(enum.Enum):
    """How the cards of a node are shared between replicas."""

    MPS = "mps"
    TIME_SLICING = "time-slicing"


@dataclass(frozen=True, slots=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str


class CommandRunner(Protocol):
    """Runs one command. Must return within ``timeout`` seconds (a command still running then counts as failed,
    returncode -1) and never raise for the command's own failure."""

    def __call__(self, argv: Sequence[str], *, stdin: str, env: Mapping[str, str], timeout: float) -> CommandResult: ...


def run_command(argv: Sequence[str], *, stdin: str, env: Mapping[str, str], timeout: float) -> CommandResult:
    """The real :class:`CommandRunner`: ``subprocess.run`` with the environment merged over this process's."""
    try:
        done = subprocess.run(  # argv is ours, never a shell
            list(argv),
            input=stdin,
            capture_output=True,
            text=True,
            env={**os.environ, **env},
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return CommandResult(-1, "", f"{argv[0]} did not answer within {timeout:g} s")
    except OSError as exc:
        return CommandResult(-1, "", str(exc))
    return CommandResult(done.returncode, done.stdout, done.stderr)


class ComputeModes(Protocol):
    """Reads and sets a card's compute mode. ``set`` returns False (and changes nothing) where the driver or the
    user's rights do not allow it; neither method raises."""

    def get(self, index: int) -> int | None: ...

    def set(self, index: int, mode: int) -> bool: ...


EXCLUSIVE_PROCESS = 3
"""NVML's ``NVML_COMPUTEMODE_EXCLUSIVE_PROCESS``."""


class NvmlComputeModes:
    """:class:`ComputeModes` through an initialised NVML module (``pynvml`` or a fake)."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml

    def get(self, index: int) -> int | None:
        try:
            return int(self.nvml.nvmlDeviceGetComputeMode(self.nvml.nvmlDeviceGetHandleByIndex(index)))
        except Exception:  # NVMLError of any kind: the mode is unknown
            return None

    def set(self, index: int, mode: int) -> bool:
        try:
            self.nvml.nvmlDeviceSetComputeMode(self.nvml.nvmlDeviceGetHandleByIndex(index), mode)
        except Exception:  # NoPermission (not root), NotSupported: keep the card as it is
            return False
        return True


@dataclass(frozen=True, slots=True)
class MpsCheck:
    """What one :meth:`MpsDaemon.check` found."""

    daemon_restarted: bool = False
    """The control daemon had stopped answering and was started again."""
    servers_lost: tuple[int, ...] = ()
    """PIDs of MPS servers that were running at the last check and are gone now."""

    @property
    def clients_lost(self) -> bool:
        """Whether the replicas on this node's shared cards lost their contexts and must restart."""
        return self.daemon_restarted or bool(self.servers_lost)


@dataclass(slots=True)
class MpsDaemon:
    """The MPS control daemon of one node (see the module docstring)."""

    state_dir: Path
    cards: Sequence[int] = ()
    """The node's card indices (their compute modes are set at start and restored at stop)."""
    binary: str = CONTROL_BINARY
    runner: CommandRunner = run_command
    compute_modes: ComputeModes | None = None
    start_timeout_s: float = 10.0
    command_timeout_s: float = 5.0
    mode: SharingMode = SharingMode.TIME_SLICING
    reason: str = "not started"
    restarts: int = 0
    _servers: set[int] = field(default_factory=set)
    _saved_modes: dict[int, int] = field(default_factory=dict)

    @property
    def pipe_dir(self) -> Path:
        return self.state_dir / "mps" / "pipe"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "mps" / "log"

    def environment(self) -> dict[str, str]:
        """What a GPU replica of this node needs to reach the daemon (nothing under time-slicing)."""
        if self.mode is not SharingMode.MPS:
            return {}
        return {PIPE_ENV: str(self.pipe_dir), LOG_ENV: str(self.log_dir)}

    def _env(self) -> dict[str, str]:
        return {PIPE_ENV: str(self.pipe_dir), LOG_ENV: str(self.log_dir)}

    def _resolved(self) -> str | None:
        return self.binary if os.sep in self.binary and os.access(self.binary, os.X_OK) else shutil.which(self.binary)

    def start(self) -> SharingMode:
        """Start the daemon (or adopt one that already answers on our pipe folder); on failure fall back to
        time-slicing with the reason. Never raises."""
        binary = self._resolved()
        if binary is None:
            return self._fallback(f"{self.binary} not found on PATH (install the NVIDIA driver's MPS tools)")
        self.binary = binary
        self.pipe_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self._answers():
            log.info("MPS control daemon already running on %s: adopted", self.pipe_dir)
        else:
            result = self.runner([binary, "-d"], stdin="", env=self._env(), timeout=self.command_timeout_s)
            if result.returncode != 0:
                return self._fallback(f"{binary} -d failed: {(result.stderr or result.stdout).strip() or 'no output'}")
            deadline = time.monotonic() + self.start_timeout_s
            while not self._answers():
                if time.monotonic() > deadline:
                    return self._fallback(f"the MPS control daemon did not answer within {self.start_timeout_s:g} s")
                time.sleep(0.05)
        self._exclusive()
        self.mode, self.reason = SharingMode.MPS, f"MPS control daemon on {self.pipe_dir}"
        self._servers = set(self.servers() or ())
        return self.mode

    def _fallback(self, reason: str) -> SharingMode:
        log.warning("GPU sharing falls back to time-slicing: %s", reason)
        self.mode, self.reason = SharingMode.TIME_SLICING, reason
        return self.mode

    def _exclusive(self) -> None:
        if self.compute_modes is None:
            return
        for index in self.cards:
            before = self.compute_modes.get(index)
            if before is None or before == EXCLUSIVE_PROCESS:
                continue
            if self.compute_modes.set(index, EXCLUSIVE_PROCESS):
                self._saved_modes[index] = before
            else:
                log.info("card %d stays in compute mode %d (not allowed to set EXCLUSIVE_PROCESS)", index, before)

    def command(self, text: str) -> CommandResult:
        """Send one control command (``get_server_list``, ``quit``, ...) to the daemon."""
        return self.runner([self.binary], stdin=text + "\n", env=self._env(), timeout=self.command_timeout_s)

    def _answers(self) -> bool:
        return self.servers() is not None

    def servers(self) -> list[int] | None:
        """PIDs of the daemon's MPS servers, or None when the daemon does not answer."""
        result = self.command("get_server_list")
        if result.returncode != 0:
            return None
        try:
            return [int(word) for word in result.stdout.split()]
        except ValueError:
            return None

    def check(self) -> MpsCheck:
        """See the module docstring. Under time-slicing there is nothing to check."""
        if self.mode is not SharingMode.MPS:
            return MpsCheck()
        servers = self.servers()
        if servers is None:
            log.error("the MPS control daemon stopped answering: restarting it; replicas on shared cards restart")
            self.restarts += 1
            self.mode = SharingMode.TIME_SLICING
            self.start()
            return MpsCheck(daemon_restarted=True)
        lost = tuple(sorted(self._servers - set(servers)))
        self._servers = set(servers)
        if lost:
            log.error("MPS server(s) %s exited: their clients lost their contexts and restart", lost)
        return MpsCheck(servers_lost=lost)

    def stop(self) -> None:
        """Quit the daemon (its servers end with it) and restore the cards' compute modes. Never raises."""
        if self.mode is SharingMode.MPS:
            self.command("quit")
            deadline = time.monotonic() + self.start_timeout_s
            while self._answers() and time.monotonic() < deadline:
                time.sleep(0.05)
        if self.compute_modes is not None:
            for index, mode in self._saved_modes.items():
                self.compute_modes.set(index, mode)
        self._saved_modes.clear()
        self.mode, self.reason = SharingMode.TIME_SLICING, "stopped"


class SharingCollector:
    """Prometheus collector: ``octacloud_gpu_sharing{node, mode, reason}`` = 1 for each GPU node's sharing mode,
    and ``octacloud_mps_daemon_restarts_total{node}``."""

    def __init__(self, daemons: Mapping[str, MpsDaemon]) -> None:
        self.daemons = daemons

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        mode = GaugeMetricFamily(
            "octacloud_gpu_sharing",
            "How a GPU node's cards are shared: mode mps (CUDA MPS enforces compute shares) or time-slicing "
            "(MPS unavailable: memory budgets only), with the reason",
            labels=["node", "mode", "reason"],
        )
        restarts = CounterMetricFamily(
            "octacloud_mps_daemon_restarts", "Times the node's MPS control daemon was found dead and started again",
            labels=["node"],
        )  # fmt: skip
        for node, daemon in sorted(self.daemons.items()):
            mode.add_metric([node, daemon.mode.value, daemon.reason], 1.0)
            restarts.add_metric([node], float(daemon.restarts))
        yield mode
        yield restarts
