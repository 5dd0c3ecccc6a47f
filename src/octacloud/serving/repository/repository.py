"""A Triton-layout model repository: ``<root>/<model>/config.pbtxt`` and ``<root>/<model>/<version>/model.onnx``.

Loads versions by the config's version policy, in one of Triton's model control modes, and swaps versions in
without dropping requests: a new version is loaded and warmed up first, then installed, and the old one
drains (finishes what it runs) before it is freed. A broken model is recorded with one clear reason and
never stops the others or the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from octacloud.core.clock import Clock
from octacloud.serving.errors import ModelConfigError, ModelNotFoundError, ModelNotReadyError, NotAllowedError
from octacloud.serving.generate import generative_runtimes
from octacloud.serving.memory import MemoryProbe
from octacloud.serving.model import ModelState, ModelVersion
from octacloud.serving.repository.config import CONFIG_FILE, read_config
from octacloud.serving.runtime import RuntimeFactory, default_runtimes, thread_budget

log = logging.getLogger(__name__)


class ControlMode(enum.Enum):
    """Triton's model control modes."""

    NONE = "none"  # load everything at start; no changes afterwards
    POLL = "poll"  # load everything at start; re-scan the repository periodically and apply changes
    EXPLICIT = "explicit"  # load what start names; then only by the repository API


@dataclass(frozen=True, slots=True)
class RepositoryEntry:
    """One line of the repository index."""

    name: str
    version: str = ""
    state: str = ""
    reason: str = ""


@dataclass(slots=True)
class _Slot:
    versions: dict[str, ModelVersion] = field(default_factory=dict)
    default: ModelVersion | None = None
    signature: dict[str, tuple[tuple[str, int, int], ...]] = field(default_factory=dict)
    error: str = ""
    failed_signature: tuple[tuple[str, int, int], ...] = ()


def is_model_name(name: str) -> bool:
    """Whether ``name`` can name a model of a repository: one folder directly under its root (one path
    component, not hidden, no separator), so that no name reaches a path outside the repository."""
    return (
        0 < len(name) <= 255 and not name.startswith(".") and "/" not in name and "\\" not in name and "\0" not in name
    )


def _stat_signature(path: Path) -> tuple[tuple[str, int, int], ...]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    out = []
    for p in files:
        with contextlib.suppress(OSError):
            st = p.stat()
            out.append((str(p), st.st_mtime_ns, st.st_size))
    return tuple(out)


class ModelRepository:
    """The models of one replica. Every public method is called on the event loop."""

    def __init__(
        self,
        root: Path | str,
        *,
        control_mode: ControlMode = ControlMode.NONE,
        runtimes: Mapping[str, RuntimeFactory] | None = None,
        threads: int | None = None,
        poll_interval_s: float = 15.0,
        clock: Clock | None = None,
        probe: MemoryProbe | None = None,
    ) -> None:
        self.root = Path(root)
        self.control_mode = control_mode
        self.runtimes = dict(runtimes) if runtimes is not None else {**default_runtimes(), **generative_runtimes()}
        self.threads = thread_budget(threads)
        self.poll_interval_s = poll_interval_s
        self._clock = clock
        self._probe = probe
        self._slots: dict[str, _Slot] = {}
        self._lock = asyncio.Lock()
        self._draining: set[asyncio.Task[None]] = set()
        self._poller: asyncio.Task[None] | None = None

    # ---- start / stop ------------------------------------------------------------------------------------
    async def start(self, load: Sequence[str] = ()) -> None:
        """Load the initial models: all of them (modes none/poll, or explicit with ``load`` = ["*"]), else
        those named. A model that fails is recorded; the others load."""
        if not self.root.is_dir():
            raise ModelConfigError(f"model repository {self.root} is not a directory")
        names = self.model_names() if self.control_mode is not ControlMode.EXPLICIT or "*" in load else load
        for name in names:
            try:
                await self._load(name)
            except (ModelConfigError, ModelNotFoundError) as e:
                log.error("model %s failed to load: %s", name, e)
        if self.control_mode is ControlMode.POLL:
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever(), name="repository-poll")

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        async with self._lock:
            for name in list(self._slots):
                self._retire(self._slots.pop(name).versions.values())
        if self._draining:
            await asyncio.gather(*self._draining, return_exceptions=True)

    # ---- lookups (the hot path) --------------------------------------------------------------------------
    def get(self, name: str, version: str = "") -> ModelVersion:
        """The READY version to serve (``version`` "" = the latest loaded). Raises NotFound / NotReady."""
        slot = self._slots.get(name)
        if slot is None or slot.default is None:
            if slot is not None and slot.error:
                raise ModelNotReadyError(f"model {name!r} is not available: {slot.error}")
            if is_model_name(name) and (self.root / name).is_dir():
                raise ModelNotReadyError(f"model {name!r} is not loaded; load it with the repository API")
            raise ModelNotFoundError(f"unknown model {name!r}; known models: {', '.join(self.model_names())}")
        if not version:
            return slot.default
        model = slot.versions.get(version)
        if model is None:
            loaded = ", ".join(sorted(slot.versions, key=int))
            raise ModelNotFoundError(f"model {name!r} has no version {version!r} loaded (loaded: {loaded})")
        return model

    def versions(self, name: str) -> list[ModelVersion]:
        slot = self._slots.get(name)
        return [slot.versions[v] for v in sorted(slot.versions, key=int)] if slot else []

    def loaded(self) -> list[ModelVersion]:
        return [m for name in sorted(self._slots) for m in self.versions(name)]

    def model_names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))

    def index(self, ready_only: bool = False) -> list[RepositoryEntry]:
        out: list[RepositoryEntry] = []
        for name in sorted({*self.model_names(), *self._slots}):
            slot = self._slots.get(name)
            if slot is not None and slot.versions:
                out.extend(RepositoryEntry(name, v.version, v.state.value, "") for v in self.versions(name))
            elif not ready_only:
                reason = slot.error if slot is not None else ""
                out.append(RepositoryEntry(name, "", "UNAVAILABLE" if slot is not None else "", reason))
        return [e for e in out if not ready_only or e.state == ModelState.READY.value]

    # ---- repository API ----------------------------------------------------------------------------------
    async def load(self, name: str) -> None:
        """Load (or reload what changed in) a model. Only in control mode explicit."""
        self._require_explicit("load")
        await self._load(name)

    async def unload(self, name: str) -> None:
        """Unload every version of a model once in-flight requests finish. Only in control mode explicit."""
        self._require_explicit("unload")
        async with self._lock:
            slot = self._slots.pop(name, None)
            if slot is None or not slot.versions:
                if slot is None and not (is_model_name(name) and (self.root / name).is_dir()):
                    raise ModelNotFoundError(f"unknown model {name!r}")
                return
            for m in slot.versions.values():
                m.state = ModelState.UNLOADING
        await asyncio.gather(*(m.unload() for m in slot.versions.values()))

    def _require_explicit(self, what: str) -> None:
        if self.control_mode is not ControlMode.EXPLICIT:
            raise NotAllowedError(
                f"explicit model {what} is not allowed in model control mode {self.control_mode.value!r}; "
                "start the server with --model-control-mode explicit"
            )

    # ---- loading -----------------------------------------------------------------------------------------
    async def _load(self, name: str) -> None:
        async with self._lock:
            slot = self._slots.setdefault(name, _Slot())
            try:
                await self._load_locked(name, slot)
                slot.error = ""
            except ModelConfigError as e:
                slot.error = f"model {name!r}: {e}"
                slot.failed_signature = _stat_signature(self.root / name)
                if not slot.versions:
                    slot.default = None
                raise ModelConfigError(slot.error) from None
            except ModelNotFoundError:
                if not slot.versions:
                    self._slots.pop(name, None)
                raise

    async def _load_locked(self, name: str, slot: _Slot) -> None:
        model_dir = self.root / name
        if not is_model_name(name) or not model_dir.is_dir():
            raise ModelNotFoundError(f"unknown model {name!r}; known models: {', '.join(self.model_names())}")
        config = read_config(model_dir)
        wanted = self._select_versions(model_dir, config)
        config_sig = _stat_signature(model_dir / CONFIG_FILE)
        keep: dict[str, ModelVersion] = {}
        fresh: dict[str, ModelVersion] = {}
        signature = {"": config_sig}
        try:
            for version in wanted:
                vdir = model_dir / version
                sig = _stat_signature(vdir)
                signature[version] = sig
                old = slot.versions.get(version)
                if old is not None and slot.signature.get(version) == sig and slot.signature.get("") == config_sig:
                    keep[version] = old
                    continue
                factory = self._factory(config, vdir)
                loader = getattr(factory, "version_class", ModelVersion)  # a generative backend's own kind
                fresh[version] = await loader.load(
                    name, version, vdir, config, factory, self.threads, clock=self._clock, probe=self._probe
                )
        except ModelConfigError:
            for m in fresh.values():
                await m.unload()
            raise
        retired = [m for v, m in slot.versions.items() if keep.get(v) is not m]
        slot.versions = {**keep, **fresh}
        slot.default = slot.versions[max(slot.versions, key=int)]
        slot.signature = signature
        self._retire(retired)
        if fresh:
            log.info("model %s: loaded version(s) %s", name, ", ".join(sorted(fresh, key=int)))

    def _retire(self, models: Iterable[ModelVersion]) -> None:
        """Unload replaced versions in the background: they finish their in-flight requests first."""
        for m in list(models):
            m.state = ModelState.UNLOADING
            task = asyncio.get_running_loop().create_task(m.unload())
            self._draining.add(task)
            task.add_done_callback(self._draining.discard)

    def _select_versions(self, model_dir: Path, config: mc.ModelConfig) -> list[str]:
        present = sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())
        if not present:
            raise ModelConfigError(f"{model_dir} has no version folder; put the model in {model_dir}/1/model.onnx")
        policy = config.version_policy
        which = policy.WhichOneof("policy_choice")
        if which == "all":
            chosen = present
        elif which == "specific":
            missing = [v for v in policy.specific.versions if v not in present]
            if missing:
                raise ModelConfigError(f"version policy names version(s) {missing} but {model_dir} has only {present}")
            chosen = sorted(int(v) for v in policy.specific.versions)
        else:
            n = policy.latest.num_versions if which == "latest" else 1
            chosen = present[-max(1, n) :]
        return [str(v) for v in chosen]

    def _factory(self, config: mc.ModelConfig, version_dir: Path) -> RuntimeFactory:
        for key in (config.backend, config.platform):
            if key:
                factory = self.runtimes.get(key)
                if factory is None:
                    known = ", ".join(sorted(self.runtimes))
                    raise ModelConfigError(f"backend/platform {key!r} is not supported; this server runs: {known}")
                return factory
        for factory in self.runtimes.values():
            if (version_dir / (config.default_model_filename or "model.onnx")).is_file():
                return factory
        raise ModelConfigError(
            f"{version_dir / (config.default_model_filename or 'model.onnx')} is missing "
            "(and the config names no backend)"
        )

    # ---- polling -----------------------------------------------------------------------------------------
    async def poll(self) -> None:
        """Apply the repository's changes: load new or changed models, unload removed ones."""
        names = set(self.model_names())
        for name in sorted(names):
            slot = self._slots.get(name)
            if slot is not None and not self._changed(name, slot):
                continue
            try:
                await self._load(name)
            except (ModelConfigError, ModelNotFoundError) as e:
                log.error("model %s failed to load: %s", name, e)
        for name in [n for n in self._slots if n not in names]:
            async with self._lock:
                slot = self._slots.pop(name)
                self._retire(slot.versions.values())

    def _changed(self, name: str, slot: _Slot) -> bool:
        model_dir = self.root / name
        if slot.error:
            return _stat_signature(model_dir) != slot.failed_signature
        if _stat_signature(model_dir / CONFIG_FILE) != slot.signature.get(""):
            return True
        try:
            wanted = self._select_versions(model_dir, read_config(model_dir))
        except ModelConfigError:
            return True
        if set(wanted) != set(slot.versions):
            return True
        return any(_stat_signature(model_dir / v) != slot.signature.get(v) for v in wanted)

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                await self.poll()
            except Exception:  # never let polling die
                log.exception("repository poll failed")
