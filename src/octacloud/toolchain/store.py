"""Publishing conversions into a model store (``octacloud convert --publish URL``).

:class:`StoreRepository` is a :class:`ModelRepository` whose versions go to a :class:`ModelStore` (an S3 bucket,
any fsspec URL): variants are built and checked in a local staging folder as usual, then each is uploaded as
the model's next version — files, its manifest (the moment it becomes visible), then the config
(:mod:`octacloud.storage.publish`). A folder URL publishes in place with ``rename``, as ``--repository`` does.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from octacloud.core.errors import InvalidSpecError, NotFoundError
from octacloud.storage.publish import publish_version
from octacloud.storage.store import CONFIG_FILE, FsspecStore, ModelStore
from octacloud.toolchain.profile import write_profile
from octacloud.toolchain.repository import (
    ModelRepository,
    PublishedVersion,
    StagedModel,
    _signature,
    check_model_name,
    config_text,
)


class StoreRepository(ModelRepository):
    """Publishes into ``store``; stages in a private temporary folder."""

    def __init__(self, store: ModelStore) -> None:
        self.store = store
        self._scratch = Path(tempfile.mkdtemp(prefix="octacloud-publish-"))
        super().__init__(self._scratch)

    def models(self) -> list[str]:
        return self.store.models()

    def versions(self, name: str) -> list[int]:
        try:
            return self.store.versions(name)
        except NotFoundError:
            return []

    def config(self, name: str) -> mc.ModelConfig:
        from google.protobuf import text_format

        config = mc.ModelConfig()
        try:
            text_format.Parse(self.store.read(name, CONFIG_FILE).decode(), config)
        except text_format.ParseError as e:
            where = f"{self.store.url}/{name}/{CONFIG_FILE}"
            raise InvalidSpecError(f"{where}: not a valid Triton model configuration: {e}") from None
        return config

    def check_compatible(self, name: str, config: mc.ModelConfig) -> None:
        try:
            current = self.config(name)
        except NotFoundError:
            return
        if _signature(current) != _signature(config):
            raise InvalidSpecError(
                f"model {name!r} already exists in {self.store.url} with different inputs, outputs or "
                "max_batch_size; all versions of a model share one config.pbtxt, so publish under a new --name"
            )

    def publish(self, staged: Sequence[StagedModel]) -> list[PublishedVersion]:
        """Upload every staged variant as its model's next version (one after the other; a failure stops the
        rest, and what was uploaded of the failed one is never listed: its manifest is written last)."""
        for s in staged:
            check_model_name(s.name)
            self.check_compatible(s.name, s.config)
        done = []
        for s in staged:
            version = max(self.versions(s.name), default=0) + 1
            profile = dataclasses.replace(s.profile, model=s.name, version=version)
            write_profile(profile, s.directory)
            publish_version(self.store, s.name, version, s.directory, config_text(s.config).encode())
            done.append(PublishedVersion(s.name, version, Path(s.name) / str(version), profile))
        return done

    def close(self) -> None:
        import shutil

        shutil.rmtree(self._scratch, ignore_errors=True)


def repository_for(url: str, credentials: Path | None = None) -> ModelRepository:
    """The repository ``convert`` publishes into: a folder in place, any other URL through its store."""
    store = FsspecStore(url) if credentials is None else None
    if store is not None and store.local:
        return ModelRepository(Path(store.root))
    from octacloud.storage.store import open_store

    return StoreRepository(open_store(url, credentials))
