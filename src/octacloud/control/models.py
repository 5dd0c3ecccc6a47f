"""The controller's view of the model store: which models and versions exist, what a deployment's replicas need,
and the fetch a replica (or a prefetch) runs on its node before it loads.

The controller never reads a local copy: configs, versions and sizes come from the :class:`ModelStore`
(``--model-storage``), whatever backend runs the replicas.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from octacloud.core.errors import InvalidSpecError, NotFoundError, OctacloudError
from octacloud.storage.cache import NodeCache, VersionPicker
from octacloud.storage.stats import FetchResult
from octacloud.storage.store import ModelStore


def unknown_model(store: ModelStore, model: object) -> str:
    """What a deploy of a model ``store`` does not hold says: the names closest to it, and where the list is."""
    asked = str(model)[:64]
    try:
        close = difflib.get_close_matches(asked, store.models(), n=3, cutoff=0.6)
    except (OctacloudError, OSError):  # the store cannot list its models now: no suggestion, the rest holds
        close = []
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    return f"model {asked!r} is not in the repository{hint} (`octacloud models list` shows the models it holds)"


def check_model(store: ModelStore, model: str, version: str) -> list[int]:
    """The published versions of ``model``; raises unless it has one and ``version`` ('' = its policy) is one."""
    if version and not version.isdigit():
        raise InvalidSpecError(f"version must be a whole number (a version folder), got {version!r}")
    try:
        versions = store.versions(model)
    except NotFoundError:
        raise NotFoundError(unknown_model(store, model)) from None
    if not versions:
        raise NotFoundError(f"model {model!r} has no published version in the model storage {store.url}")
    if version and int(version) not in versions:
        raise NotFoundError(
            f"model {model!r} has no version {int(version)} (its versions: {', '.join(map(str, versions))})"
        )
    return versions


def parse_config(text: bytes, where: str) -> mc.ModelConfig:
    config = mc.ModelConfig()
    try:
        text_format.Parse(text.decode("utf-8", "replace"), config)
    except text_format.ParseError as exc:
        raise InvalidSpecError(f"{where}: {exc}") from None
    return config


def needed_versions(config: mc.ModelConfig, available: Sequence[int], pinned: str = "") -> list[int]:
    """The versions a replica serves: the pinned one, else what the model's version policy selects (Triton's
    rules: ``latest { num_versions: N }`` — 1 by default —, ``all``, or ``specific { versions: [...] }``)."""
    present = sorted(available)
    if pinned:
        return [int(pinned)]
    policy = config.version_policy
    which = policy.WhichOneof("policy_choice")
    if which == "all":
        return present
    if which == "specific":
        return sorted(v for v in set(policy.specific.versions) if v in present)
    count = max(1, policy.latest.num_versions) if which == "latest" else 1
    return present[-count:]


def version_picker(model: str, pinned: str) -> VersionPicker:
    def pick(config: bytes, available: list[int]) -> list[int]:
        return needed_versions(parse_config(config, f"{model}/config.pbtxt"), available, pinned)

    return pick


def fetch_model(cache: NodeCache, store: ModelStore, model: str, pinned: str, lease: str | None = None) -> FetchResult:
    """Fetch what a replica of ``model`` (pinned to version ``pinned``, or '' for its policy) needs into
    ``cache``; the result's ``path`` is then a Triton model folder (its config and the needed versions)."""
    return cache.fetch(store, model, version_picker(model, pinned), lease=lease)


class CacheIndex:
    """Which models each node's cache holds, for cache-aware placement (``model-cache`` in a profile).

    A node's entry is what its replicas and prefetches reported fetching (:meth:`record`); with ``local_root``
    every node is this machine, whose cache is looked at directly. Thread-safe enough for its use: a set
    replaced, never mutated while read.
    """

    def __init__(self, local_root: Path | None = None) -> None:
        self.local_root = local_root
        self._held: dict[str, frozenset[str]] = {}

    def record(self, node: str, model: str) -> None:
        self._held[node] = self._held.get(node, frozenset()) | {model}

    def holds(self, node: str, model: str) -> bool:
        if model in self._held.get(node, frozenset()):
            return True
        if self.local_root is None:
            return False
        folder = self.local_root / model
        try:
            return any(p.name.isdigit() for p in folder.iterdir())
        except OSError:
            return False
