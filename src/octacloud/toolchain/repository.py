"""Publishing into a Triton-layout model repository, atomically.

Layout (Triton's)::

    <repository>/<model>/config.pbtxt
    <repository>/<model>/<version>/model.onnx      the graph
    <repository>/<model>/<version>/profile.json    its measured profile (octacloud.toolchain.profile)
    <repository>/<model>/<version>/parity.json     its parity report against the source framework
    <repository>/<model>/<version>/octacloud-manifest.json   size and SHA-256 of each file (storage/manifest.py)

A precision variant is a model of its own (``minilm``, ``minilm_fp16``, ``minilm_int8``); every publish adds
version ``max(existing) + 1``. Files are written under ``<repository>/.octacloud-staging/`` (names starting
with ``.`` are never models) and moved in with ``rename``: a new model appears complete with its config; a new
version of an existing model appears complete, then its config is replaced atomically. A repository that is
polled therefore never sees half a model, and a publish that fails part-way is rolled back. Concurrent
publishers take turns on an exclusive ``flock`` of the repository directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import shutil
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from octacloud.core.errors import InvalidSpecError
from octacloud.storage.manifest import write_manifest
from octacloud.toolchain.profile import ModelProfile, Precision, write_profile
from octacloud.toolchain.spec import TensorSpec, triton_type

CONFIG_FILENAME: Final = "config.pbtxt"
MODEL_FILENAME: Final = "model.onnx"
STAGING_DIRNAME: Final = ".octacloud-staging"
WEIGHTS_BYTES_PARAM: Final = "octacloud.weights_bytes"
BYTES_PER_SAMPLE_PARAM: Final = "octacloud.bytes_per_sample"
PRECISION_PARAM: Final = "octacloud.precision"
DEFAULT_MAX_QUEUE_DELAY_US: Final = 2000


def variant_name(base: str, precision: Precision) -> str:
    """The repository name of ``base`` in ``precision``: fp32 keeps the base name."""
    return base if precision == "fp32" else f"{base}_{precision}"


def check_model_name(name: str) -> None:
    if not name or name.startswith(".") or "/" in name or name != name.strip() or name in ("..",):
        raise InvalidSpecError(
            f"model name {name!r} is not usable as a repository directory (no '/', no leading '.', not empty)"
        )


def build_config(
    name: str,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    *,
    max_batch_size: int,
    weights_bytes: int,
    bytes_per_sample: int,
    precision: Precision,
    max_queue_delay_us: int = DEFAULT_MAX_QUEUE_DELAY_US,
    parameters: Mapping[str, str] | None = None,
) -> mc.ModelConfig:
    """Triton's ``ModelConfig`` for an ONNX model with a batch axis, dynamic batching and our parameters."""
    config = mc.ModelConfig(
        name=name, platform="onnxruntime_onnx", backend="onnxruntime", max_batch_size=max_batch_size
    )
    for spec in inputs:
        config.input.add(
            name=spec.name,
            data_type=mc.DataType.Value(triton_type(spec.dtype)),
            dims=[-1 if d is None else d for d in spec.sample_dims],
        )
    for spec in outputs:
        config.output.add(
            name=spec.name,
            data_type=mc.DataType.Value(triton_type(spec.dtype)),
            dims=[-1 if d is None else d for d in spec.sample_dims],
        )
    config.dynamic_batching.max_queue_delay_microseconds = max_queue_delay_us
    config.parameters[WEIGHTS_BYTES_PARAM].string_value = str(weights_bytes)
    config.parameters[BYTES_PER_SAMPLE_PARAM].string_value = str(bytes_per_sample)
    config.parameters[PRECISION_PARAM].string_value = precision
    for key, value in (parameters or {}).items():  # pre-processing (toolchain/preprocessing.py)
        config.parameters[key].string_value = value
    return config


def config_text(config: mc.ModelConfig) -> str:
    return str(text_format.MessageToString(config))


def read_config(model_dir: Path) -> mc.ModelConfig:
    path = model_dir / CONFIG_FILENAME
    config = mc.ModelConfig()
    try:
        text_format.Parse(path.read_text(encoding="utf-8"), config)
    except text_format.ParseError as e:
        raise InvalidSpecError(f"{path}: not a valid Triton model configuration: {e}") from None
    return config


def versions(model_dir: Path) -> list[int]:
    """The numeric version directories of a model, ascending."""
    if not model_dir.is_dir():
        return []
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit() and int(p.name) > 0)


def _signature(config: mc.ModelConfig) -> tuple[object, ...]:
    def io(items: Sequence[mc.ModelInput] | Sequence[mc.ModelOutput]) -> tuple[object, ...]:
        return tuple((t.name, t.data_type, tuple(t.dims)) for t in items)

    return io(config.input), io(config.output), config.max_batch_size


@dataclass(frozen=True, slots=True)
class StagedModel:
    """A variant ready to publish: a directory holding ``model.onnx`` (+ ``parity.json``), its config and profile.

    The profile's ``version`` is a placeholder: :meth:`ModelRepository.publish` sets the real one.
    """

    name: str
    directory: Path
    config: mc.ModelConfig
    profile: ModelProfile


@dataclass(frozen=True, slots=True)
class PublishedVersion:
    name: str
    version: int
    path: Path
    profile: ModelProfile


class ModelRepository:
    """A Triton-layout model repository on a local file system; concurrent publishers take turns (``flock``)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def models(self) -> list[str]:
        """Names of the models in the repository (directories with a ``config.pbtxt``), sorted."""
        if not self.root.is_dir():
            return []
        return sorted(
            p.name
            for p in self.root.iterdir()
            if p.is_dir() and not p.name.startswith(".") and (p / CONFIG_FILENAME).is_file()
        )

    def versions(self, name: str) -> list[int]:
        return versions(self.root / name)

    def config(self, name: str) -> mc.ModelConfig:
        return read_config(self.root / name)

    def prune(self, name: str, keep: int) -> list[int]:
        """Remove all but the newest ``keep`` versions of ``name``; return the versions removed.

        Each version directory is renamed into the staging area before it is deleted, so a polling server
        sees it disappear at once, never half-deleted.
        """
        if keep < 1:
            raise InvalidSpecError(f"keep must be >= 1, got {keep}")
        doomed = self.versions(name)[:-keep]
        if doomed:
            with self.staging() as area:
                for v in doomed:
                    (self.root / name / str(v)).rename(area / f"{name}.{v}")
        return doomed

    def remove(self, name: str) -> bool:
        """Remove the model ``name`` with all its versions, if present (renamed away first, then deleted)."""
        check_model_name(name)
        if not (self.root / name).is_dir():
            return False
        with self.staging() as area:
            (self.root / name).rename(area / name)
        return True

    @contextlib.contextmanager
    def staging(self) -> Iterator[Path]:
        """A private scratch directory on the repository's file system (so ``rename`` into it is atomic).

        Removed on exit, whatever happens; the repository itself is not touched.
        """
        created_root = not self.root.exists()
        area = self.root / STAGING_DIRNAME
        path = area / uuid.uuid4().hex
        for attempt in range(100):
            area.mkdir(parents=True, exist_ok=True)
            try:
                path.mkdir()
                break
            except FileNotFoundError:
                # another publisher's staging ended between the two calls and removed the then empty folder
                if attempt == 99:
                    raise
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)
            with contextlib.suppress(OSError):
                area.rmdir()  # only succeeds when no other staging area is in use
                if created_root:
                    self.root.rmdir()  # only succeeds when nothing was published

    def check_compatible(self, name: str, config: mc.ModelConfig) -> None:
        """Refuse a new version whose inputs, outputs or max batch size differ from the model's current config.

        All versions of a Triton model share one ``config.pbtxt``: a different signature needs a new name.
        """
        model_dir = self.root / name
        if not (model_dir / CONFIG_FILENAME).is_file():
            return
        if _signature(read_config(model_dir)) != _signature(config):
            raise InvalidSpecError(
                f"model {name!r} already exists in {self.root} with different inputs, outputs or "
                "max_batch_size; all versions of a model share one config.pbtxt, so publish under a new --name"
            )

    def publish(self, staged: Sequence[StagedModel]) -> list[PublishedVersion]:
        """Move every staged variant into the repository as a new version; all or nothing.

        On any failure, versions already moved are removed and replaced configs restored before re-raising.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        with _locked(self.root):  # concurrent publishers take turns: versions never collide
            for s in staged:
                check_model_name(s.name)
                self.check_compatible(s.name, s.config)
            done: list[tuple[PublishedVersion, str | None]] = []  # (published, previous config text or None)
            try:
                for s in staged:
                    done.append(self._publish_one(s))
            except BaseException:
                for published, previous in reversed(done):
                    _rollback(published, previous)
                raise
        return [p for p, _ in done]

    def _publish_one(self, s: StagedModel) -> tuple[PublishedVersion, str | None]:
        version = (max(versions(self.root / s.name), default=0)) + 1
        profile = dataclasses.replace(s.profile, model=s.name, version=version)
        write_profile(profile, s.directory)
        write_manifest(s.directory)  # size and SHA-256 of every file: node caches check what they fetch
        path, previous = self._install(s.name, version, s.directory, config_text(s.config))
        return PublishedVersion(s.name, version, path, profile), previous

    def publish_files(self, name: str, directory: Path, config: mc.ModelConfig) -> tuple[int, Path]:
        """Move ``directory`` (a version's files, staged under :meth:`staging`) into the repository as the next
        version of ``name``, with ``config``; for models the toolchain does not profile (a generative model's
        GGUF). Returns the version and its folder."""
        check_model_name(name)
        self.root.mkdir(parents=True, exist_ok=True)
        with _locked(self.root):
            version = (max(versions(self.root / name), default=0)) + 1
            write_manifest(directory)
            path, _ = self._install(name, version, directory, config_text(config))
        return version, path

    def _install(self, name: str, version: int, directory: Path, text: str) -> tuple[Path, str | None]:
        """Rename ``directory`` in as ``<name>/<version>`` and write the config; returns the version's folder and
        the config it replaced (None: the model is new)."""
        model_dir = self.root / name
        if not model_dir.exists():
            # A new model: assemble <model>/config.pbtxt + <model>/1/ beside the staged version, rename once.
            shell = directory.parent / f"{name}.model"
            shell.mkdir()
            (shell / CONFIG_FILENAME).write_text(text, encoding="utf-8")
            directory.rename(shell / str(version))
            shell.rename(model_dir)
            return model_dir / str(version), None
        config_file = model_dir / CONFIG_FILENAME
        previous = config_file.read_text(encoding="utf-8") if config_file.is_file() else _NO_CONFIG
        target = model_dir / str(version)
        directory.rename(target)
        try:
            _atomic_write(model_dir / CONFIG_FILENAME, text)
        except BaseException:
            _remove_version(target, previous)
            raise
        return target, previous


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """An exclusive ``flock`` on the directory itself (no lock file left in the repository)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


_NO_CONFIG: Final = ""
"""The model directory existed but held no config.pbtxt (rollback removes the one written)."""


def _rollback(published: PublishedVersion, previous_config: str | None) -> None:
    _remove_version(published.path, previous_config)


def _remove_version(path: Path, previous_config: str | None) -> None:
    if previous_config is None:  # the whole model was new
        shutil.rmtree(path.parent, ignore_errors=True)
        return
    shutil.rmtree(path, ignore_errors=True)
    config_file = path.parent / CONFIG_FILENAME
    with contextlib.suppress(OSError):
        if previous_config == _NO_CONFIG:
            config_file.unlink(missing_ok=True)
        else:
            _atomic_write(config_file, previous_config)
