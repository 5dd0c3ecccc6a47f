"""Profiles from files: a plugin set with weights and arguments, in YAML or TOML, validated with clear errors.

A profile file::

    name: fgd
    description: Fragmentation gradient descent, as published.
    random_choice: false          # optional: pick a random feasible node (the Random baseline)
    plugins:                      # in order; each instance joins every extension point its kind implements
      - plugin: resource-fit
      - plugin: fgd
        weight: 1                 # scorers only; default 1; 0 keeps the plugin's other roles but not its score
      - plugin: telemetry
        name: gpu-util            # instance name (default: the kind); must be unique in the profile
        weight: 0.5
        args: {metric: gpu_utilisation, prefer: low}

Any unknown key, unknown plugin, bad weight or bad argument raises :class:`InvalidSpecError` naming the file and
the key (``profile.yaml: plugins[2].args.metric: ...``).
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from importlib import resources
from pathlib import Path

import yaml

from octacloud.core.errors import InvalidSpecError
from octacloud.scheduler.framework.api import (
    CardSelector,
    FilterPlugin,
    PreFilterPlugin,
    RequestRewriter,
    ReservePlugin,
    ScorePlugin,
)
from octacloud.scheduler.framework.runner import Profile, WeightedScorer
from octacloud.scheduler.plugins import REGISTRY
from octacloud.scheduler.registry import PluginContext, PluginRegistry

PROFILE_KEYS = ("name", "description", "random_choice", "plugins")
ENTRY_KEYS = ("plugin", "name", "weight", "args")
BUILTIN_PACKAGE = "octacloud.scheduler.builtin"


def read_profile_file(path: str | Path) -> Mapping[str, object]:
    """Parse a YAML (``.yaml``/``.yml``) or TOML (``.toml``) profile file into a mapping."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidSpecError(f"{p}: cannot read the profile ({exc.strerror or exc})") from None
    try:
        if p.suffix == ".toml":
            data: object = tomllib.loads(text)
        elif p.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        else:
            raise InvalidSpecError(f"{p}: a profile must be a .yaml, .yml or .toml file")
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        raise InvalidSpecError(f"{p}: not valid {p.suffix[1:].upper()}: {exc}") from None
    if not isinstance(data, Mapping):
        raise InvalidSpecError(f"{p}: a profile must be a mapping with keys {list(PROFILE_KEYS)}")
    return data


def load_profile(
    path: str | Path, *, context: PluginContext | None = None, registry: PluginRegistry = REGISTRY
) -> Profile:
    """Load and validate a profile file."""
    p = Path(path)
    return parse_profile(read_profile_file(p), source=str(p), default_name=p.stem, context=context, registry=registry)


def parse_profile(
    data: Mapping[str, object],
    *,
    source: str,
    default_name: str = "profile",
    context: PluginContext | None = None,
    registry: PluginRegistry = REGISTRY,
) -> Profile:
    """Build a :class:`Profile` from parsed file content; ``source`` names the file in errors."""
    ctx = context or PluginContext()
    unknown = sorted(set(data) - set(PROFILE_KEYS))
    if unknown:
        raise InvalidSpecError(f"{source}: unknown key(s) {unknown}; a profile has {list(PROFILE_KEYS)}")
    name = data.get("name", default_name)
    if not isinstance(name, str) or not name:
        raise InvalidSpecError(f"{source}: name: expected a non-empty string, got {name!r}")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise InvalidSpecError(f"{source}: description: expected a string, got {description!r}")
    random_choice = data.get("random_choice", False)
    if not isinstance(random_choice, bool):
        raise InvalidSpecError(f"{source}: random_choice: expected true or false, got {random_choice!r}")
    entries = data.get("plugins")
    if not isinstance(entries, list) or not entries:
        raise InvalidSpecError(f"{source}: plugins: expected a non-empty list of plugin entries, got {entries!r}")
    profile = Profile(name, random_choice=random_choice, seed=ctx.seed, description=description)
    seen: set[str] = set()
    for k, entry in enumerate(entries):
        _add_entry(profile, entry, f"{source}: plugins[{k}]", seen, ctx, registry)
    return profile


def _add_entry(
    profile: Profile, entry: object, where: str, seen: set[str], ctx: PluginContext, registry: PluginRegistry
) -> None:
    if isinstance(entry, str):
        entry = {"plugin": entry}
    if not isinstance(entry, Mapping):
        raise InvalidSpecError(f"{where}: expected a plugin name or a mapping with {list(ENTRY_KEYS)}")
    unknown = sorted(set(entry) - set(ENTRY_KEYS))
    if unknown:
        raise InvalidSpecError(f"{where}: unknown key(s) {unknown}; a plugin entry has {list(ENTRY_KEYS)}")
    kind = entry.get("plugin")
    if not isinstance(kind, str) or not kind:
        raise InvalidSpecError(f"{where}.plugin: expected a plugin name, got {kind!r}")
    name = entry.get("name", kind)
    if not isinstance(name, str) or not name:
        raise InvalidSpecError(f"{where}.name: expected a non-empty string, got {name!r}")
    if name in seen:
        raise InvalidSpecError(f"{where}.name: {name!r} is used twice; give each instance its own name")
    seen.add(name)
    args = entry.get("args", {})
    if args is None:
        args = {}
    if not isinstance(args, Mapping):
        raise InvalidSpecError(f"{where}.args: expected a mapping, got {args!r}")
    plugin = registry.create(kind, name, args, ctx, where)
    weight = entry.get("weight")
    if isinstance(plugin, ScorePlugin):
        w = 1.0 if weight is None else weight
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) or w < 0:
            raise InvalidSpecError(f"{where}.weight: expected a finite number >= 0, got {weight!r}")
        if w > 0:
            profile.scorers.append(WeightedScorer(plugin, float(w)))
    elif weight is not None:
        raise InvalidSpecError(f"{where}.weight: plugin {kind!r} does not score nodes; remove the weight")
    if isinstance(plugin, RequestRewriter):
        profile.rewriters.append(plugin)
    if isinstance(plugin, PreFilterPlugin):
        profile.pre_filters.append(plugin)
    if isinstance(plugin, FilterPlugin):
        profile.filters.append(plugin)
    if isinstance(plugin, CardSelector):
        profile.card_selectors.append(plugin)
    if isinstance(plugin, ReservePlugin):
        profile.reservers.append(plugin)


def builtin_profile_names() -> list[str]:
    """Names of the profile files shipped with octacloud."""
    folder = resources.files(BUILTIN_PACKAGE)
    return sorted(Path(f.name).stem for f in folder.iterdir() if f.name.endswith((".yaml", ".yml", ".toml")))


def builtin_profile_path(name: str) -> Path:
    """The shipped profile file called ``name``."""
    folder = resources.files(BUILTIN_PACKAGE)
    for suffix in (".yaml", ".yml", ".toml"):
        candidate = folder / f"{name}{suffix}"
        if candidate.is_file():
            return Path(str(candidate))
    raise InvalidSpecError(f"no built-in profile {name!r}; built-in: {builtin_profile_names()}")
