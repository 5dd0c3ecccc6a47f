"""The plugin registry: plugin kinds by name, and validated plugin arguments.

A profile file names plugin *kinds* (``fgd``, ``resource-fit``, ``telemetry`` ...) with optional arguments; the
registry turns each entry into a plugin instance. Arguments are read through :class:`Args`, which checks types
and ranges and, at the end, rejects any key the plugin did not read — so a typo in a profile file is an error
naming the file and the key, never a silently ignored setting.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from octacloud.core.errors import InvalidSpecError
from octacloud.scheduler.framework.api import Plugin

if TYPE_CHECKING:
    from octacloud.scheduler.fragmentation import TargetWorkload
    from octacloud.scheduler.plugins.model_cache import CachedModels
    from octacloud.scheduler.telemetry import TelemetrySource

_N = TypeVar("_N", int, float)


@dataclass(frozen=True, slots=True)
class PluginContext:
    """What plugins may need beyond their arguments, supplied by whoever builds the profile."""

    seed: int = 0
    """Seeds random plugins (and the runner's tie-break order)."""
    workload: TargetWorkload | None = None
    """FGD's target workload; required by fragmentation-aware plugins."""
    telemetry: TelemetrySource | None = None
    """Live node metrics for telemetry-fed scoring terms."""
    model_cache: CachedModels | None = None
    """Which models the nodes' caches hold, for cache-aware placement (``model-cache``)."""


class Args:
    """Typed access to one plugin entry's arguments; :meth:`finish` rejects keys nobody read."""

    def __init__(self, values: Mapping[str, object], where: str) -> None:
        if not isinstance(values, Mapping):
            raise InvalidSpecError(f"{where}: args must be a mapping of names to values, got {values!r}")
        self._values = dict(values)
        self._read: set[str] = set()
        self.where = where

    def _get(self, key: str) -> object | None:
        self._read.add(key)
        return self._values.get(key)

    def error(self, key: str, message: str) -> InvalidSpecError:
        return InvalidSpecError(f"{self.where}.args.{key}: {message}")

    def integer(self, key: str, default: int, *, low: int | None = None, high: int | None = None) -> int:
        value = self._get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"expected a whole number, got {value!r}")
        return self._in_range(key, value, low, high)

    def number(self, key: str, default: float, *, low: float | None = None, high: float | None = None) -> float:
        value = self._get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            raise self.error(key, f"expected a number, got {value!r}")
        return self._in_range(key, float(value), low, high)

    def flag(self, key: str, default: bool) -> bool:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(key, f"expected true or false, got {value!r}")
        return value

    def text(self, key: str, default: str | None, *, choices: tuple[str, ...] = ()) -> str:
        value = self._get(key)
        if value is None:
            if default is None:
                raise self.error(key, "is required" + (f"; one of {list(choices)}" if choices else ""))
            return default
        if not isinstance(value, str) or not value:
            raise self.error(key, f"expected a non-empty string, got {value!r}")
        if choices and value not in choices:
            raise self.error(key, f"must be one of {list(choices)}, got {value!r}")
        return value

    def names(self, key: str, default: tuple[str, ...] = ()) -> tuple[str, ...]:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) and v for v in value):
            raise self.error(key, f"expected a list of names, got {value!r}")
        return tuple(value)

    def finish(self) -> None:
        unknown = sorted(set(self._values) - self._read)
        if unknown:
            allowed = sorted(self._read)
            raise InvalidSpecError(
                f"{self.where}.args: unknown key(s) {unknown}; this plugin accepts {allowed or 'no arguments'}"
            )

    def _in_range(self, key: str, value: _N, low: _N | None, high: _N | None) -> _N:
        if low is not None and value < low:
            raise self.error(key, f"must be >= {low}, got {value}")
        if high is not None and value > high:
            raise self.error(key, f"must be <= {high}, got {value}")
        return value


PluginFactory = Callable[[str, Args, PluginContext], Plugin]
"""Builds a plugin instance named ``name`` from validated arguments."""


@dataclass(frozen=True, slots=True)
class PluginKind:
    name: str
    factory: PluginFactory
    summary: str


class PluginRegistry:
    """Plugin kinds by name. Guarantees: :meth:`create` either returns a plugin or raises InvalidSpecError."""

    def __init__(self) -> None:
        self._kinds: dict[str, PluginKind] = {}

    def register(self, kind: str, factory: PluginFactory, summary: str = "") -> None:
        if kind in self._kinds:
            raise ValueError(f"plugin kind {kind!r} is already registered")
        self._kinds[kind] = PluginKind(kind, factory, summary)

    def kinds(self) -> list[PluginKind]:
        return sorted(self._kinds.values(), key=lambda k: k.name)

    def __contains__(self, kind: object) -> bool:
        return kind in self._kinds

    def create(self, kind: str, name: str, args: Mapping[str, object], ctx: PluginContext, where: str) -> Plugin:
        entry = self._kinds.get(kind)
        if entry is None:
            raise InvalidSpecError(f"{where}.plugin: unknown plugin {kind!r}; known: {sorted(self._kinds)}")
        reader = Args(args, where)
        plugin = entry.factory(name, reader, ctx)
        reader.finish()
        return plugin
