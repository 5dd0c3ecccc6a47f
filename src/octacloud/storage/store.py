"""The model store: one Triton-layout model repository behind a URL, read by the controller, the toolchain and
every node's cache.

``--model-storage`` names it: a local folder (the default, ``models/``), ``s3://bucket/prefix`` on any
S3-compatible endpoint, or any other URL fsspec knows (``gs://``, ``az://``, ``memory://`` ...). Layout::

    <store>/<model>/config.pbtxt
    <store>/<model>/<version>/model.onnx ...
    <store>/<model>/<version>/octacloud-manifest.json    size and SHA-256 of every file (storage/manifest.py)

A version of an object store is *published* once its manifest is there (the publisher uploads it last), so a
reader never takes half an upload for a version; a local folder's versions are complete as soon as they
appear (the toolchain moves them in with ``rename``), manifest or not.

S3 credentials come from where the AWS SDK looks (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
``AWS_PROFILE`` and ``~/.aws``, instance roles) or from a file named on the command line (``--storage-credentials``,
AWS's shared-credentials format, which may also name ``endpoint_url`` and ``region``); the endpoint comes from
that file, ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``. Every failure to read the store is a
:class:`StoreUnavailableError` that names the store and the reason (refused credentials, a missing bucket, an
endpoint that does not answer): never a raw SDK traceback.
"""

from __future__ import annotations

import configparser
import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from octacloud.core.errors import InvalidSpecError, NotFoundError, OctacloudError

MANIFEST_FILE = "octacloud-manifest.json"
"""A published version's manifest, in its version folder."""
CONFIG_FILE = "config.pbtxt"


class StoreUnavailableError(OctacloudError):
    """The model store cannot be read now: it does not answer, refuses the credentials, or lacks its bucket.
    The message names the store and the reason."""


@dataclass(frozen=True, slots=True)
class StoreFile:
    """One file of a model as the store lists it."""

    size: int
    marker: str | None = None
    """A change marker (ETag, mtime): differs when the file was rewritten."""


class ModelStore(Protocol):
    """A Triton-layout model repository behind a URL.

    ``url`` names the store (never its credentials). Reads are fresh: no listing is cached between calls.
    Every method raises :class:`NotFoundError` for a model, version or file that is not there and
    :class:`StoreUnavailableError` (naming the store and the reason) when the store cannot be read; nothing
    else. ``versions`` lists published versions only (see the module's docstring). ``put`` writes a whole file
    (a reader sees it complete or not at all); ``remove`` deletes a model's file or folder, if present.
    """

    url: str

    def models(self) -> list[str]: ...

    def versions(self, model: str) -> list[int]: ...

    def read(self, model: str, path: str) -> bytes: ...

    def read_range(self, model: str, path: str, start: int, end: int) -> bytes: ...

    def files(self, model: str, version: int | None = None) -> dict[str, StoreFile]: ...

    def size(self, model: str) -> int: ...

    def put(self, model: str, path: str, data: bytes | Path) -> None: ...

    def remove(self, model: str, path: str) -> None: ...


@dataclass(frozen=True, slots=True)
class StoreOptions:
    """How to reach a store: fsspec storage options (credentials, endpoint), never printed."""

    options: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""
    """Where the credentials came from (for error messages): a file, or '' for the SDK's usual places."""


def credentials_from_file(path: Path) -> StoreOptions:
    """S3 options from a shared-credentials file: the section ``$AWS_PROFILE`` names, else ``default``, else the
    only one. Keys: ``aws_access_key_id``, ``aws_secret_access_key``, optional ``aws_session_token``,
    ``endpoint_url``, ``region``."""
    parser = configparser.ConfigParser()
    try:
        parser.read_string(path.read_text())
    except OSError as exc:
        raise InvalidSpecError(f"--storage-credentials {path}: cannot read it: {exc.strerror}") from None
    except configparser.Error as exc:
        raise InvalidSpecError(f"--storage-credentials {path}: not a credentials file ([profile] key = value): "
                               f"{exc.message.splitlines()[0]}") from None  # fmt: skip
    sections = parser.sections()
    wanted = os.environ.get("AWS_PROFILE") or "default"
    name = wanted if wanted in sections else (sections[0] if len(sections) == 1 else None)
    if name is None:
        raise InvalidSpecError(
            f"--storage-credentials {path}: no [{wanted}] section (has {sections or 'none'}); set AWS_PROFILE"
        )
    section = parser[name]
    missing = [k for k in ("aws_access_key_id", "aws_secret_access_key") if not section.get(k)]
    if missing:
        raise InvalidSpecError(f"--storage-credentials {path}: section [{name}] lacks {', '.join(missing)}")
    options: dict[str, Any] = {"key": section["aws_access_key_id"], "secret": section["aws_secret_access_key"]}
    if section.get("aws_session_token"):
        options["token"] = section["aws_session_token"]
    client: dict[str, Any] = {}
    if section.get("endpoint_url"):
        client["endpoint_url"] = section["endpoint_url"]
    if section.get("region"):
        client["region_name"] = section["region"]
    if client:
        options["client_kwargs"] = client
    return StoreOptions(options, str(path))


def open_store(url: str | Path, credentials: Path | None = None) -> FsspecStore:
    """The store at ``url`` (a folder, or an fsspec URL), with S3 credentials from ``credentials`` when given."""
    text = str(url)
    if credentials is not None and not text.startswith("s3://"):
        raise InvalidSpecError(f"--storage-credentials is for s3:// stores; {text} takes its own configuration")
    return FsspecStore(text, credentials_from_file(credentials) if credentials is not None else StoreOptions())


def _endpoint(options: Mapping[str, Any]) -> str:
    client = options.get("client_kwargs") or {}
    return str(
        client.get("endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
        or "the AWS default endpoint"
    )


class FsspecStore:
    """A :class:`ModelStore` on any fsspec file system (a plain path is the local one)."""

    def __init__(self, url: str, options: StoreOptions | None = None) -> None:
        import fsspec

        self.options = options or StoreOptions()
        self.local = "://" not in url or url.startswith("file://")
        if "://" not in url:
            url = Path(url).expanduser().resolve().as_uri()
        self.url = url.rstrip("/")
        kwargs = dict(self.options.options)
        if url.startswith("s3://"):
            # a store that is down answers in seconds, not after the SDK's minute of retries; listings are fresh
            kwargs.setdefault("use_listings_cache", False)
            kwargs.setdefault("config_kwargs", {"connect_timeout": 3, "read_timeout": 60,
                                                "retries": {"max_attempts": 2, "mode": "standard"}})  # fmt: skip
            kwargs.setdefault("skip_instance_cache", True)
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **kwargs)
        except (ImportError, ValueError) as exc:
            raise InvalidSpecError(f"model storage {self.url}: {exc}") from None
        self.root = str(root).rstrip("/")
        if url.startswith("s3://"):
            self.fs.retries = 2  # s3fs's own retry loop (a class attribute), on top of the SDK's

    def __repr__(self) -> str:
        return f"FsspecStore({self.url!r})"

    def __reduce__(self) -> tuple[type[FsspecStore], tuple[str, StoreOptions]]:
        """Sent to a node (a Ray actor, a prefetch task) as its URL and options; opened again there."""
        return FsspecStore, (self.url, self.options)

    @property
    def endpoint(self) -> str:
        return _endpoint(self.options.options) if self.url.startswith("s3://") else self.url

    # ---- the ModelStore contract -------------------------------------------------------------------------

    def models(self) -> list[str]:
        with self._reading():
            if not self.fs.exists(self.root):
                return []
            entries = self.fs.ls(self.root, detail=True)
        names = sorted(str(e["name"]).rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory")
        return [n for n in names if not n.startswith(".") and self._has_config(n)]

    def _has_config(self, model: str) -> bool:
        with self._reading():
            return bool(self.fs.exists(self._path(model, CONFIG_FILE)))

    def versions(self, model: str) -> list[int]:
        entries = self._list(model)
        found = sorted(int(n) for n, kind in entries.items() if kind == "directory" and n.isdigit() and int(n) > 0)
        if self.local:
            return found
        with self._reading():
            return [v for v in found if self.fs.exists(self._path(model, f"{v}/{MANIFEST_FILE}"))]

    def read(self, model: str, path: str) -> bytes:
        with self._reading(model, path):
            return bytes(self.fs.cat_file(self._path(model, path)))

    def read_range(self, model: str, path: str, start: int, end: int) -> bytes:
        with self._reading(model, path):
            return bytes(self.fs.cat_file(self._path(model, path), start=start, end=end))

    def files(self, model: str, version: int | None = None) -> dict[str, StoreFile]:
        base = self._path(model) if version is None else self._path(model, str(version))
        with self._reading(model, "" if version is None else str(version)):
            if not self.fs.isdir(base):
                raise FileNotFoundError(base)
            found: dict[str, Mapping[str, Any]] = self.fs.find(base, detail=True)
        out: dict[str, StoreFile] = {}
        for path, info in found.items():
            if info.get("type") == "directory":
                continue
            rel = str(path)[len(base) :].lstrip("/")
            if rel and not rel.startswith(".") and "/." not in rel:
                out[rel] = StoreFile(int(info.get("size") or 0), _marker(info))
        return out

    def size(self, model: str) -> int:
        return sum(f.size for f in self.files(model).values())

    def put(self, model: str, path: str, data: bytes | Path) -> None:
        target = self._path(model, path)
        with self._reading(model, path):
            if isinstance(data, Path):
                if self.local:
                    self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
                self.fs.put_file(str(data), target)
            else:
                if self.local:
                    self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
                self.fs.pipe_file(target, data)

    def remove(self, model: str, path: str) -> None:
        with self._reading(), contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._path(model, path), recursive=True)

    # ---- checks and errors -------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise :class:`StoreUnavailableError` unless the store answers now (its bucket exists, the credentials
        are accepted). A store that is a folder not created yet is fine: publishing creates it."""
        if self.local:
            return
        with self._reading():
            self.fs.ls(self.root.split("/", 1)[0])  # refused credentials, a missing bucket: raised here

    def _path(self, model: str, rel: str = "") -> str:
        if not model or "/" in model or model.startswith("."):
            raise InvalidSpecError(f"{model!r} is not a model name (no '/', no leading '.')")
        return f"{self.root}/{model}" + (f"/{rel}" if rel else "")

    def _list(self, model: str) -> dict[str, str]:
        with self._reading(model):
            entries = self.fs.ls(self._path(model), detail=True)
        return {str(e["name"]).rstrip("/").rsplit("/", 1)[-1]: str(e.get("type")) for e in entries}

    def _why(self, reason: str) -> str:
        where = f" at {self.endpoint}" if self.url.startswith("s3://") else ""
        return f"model storage {self.url}{where}: {reason}"

    @contextlib.contextmanager
    def _reading(self, model: str = "", path: str = "") -> Iterator[None]:
        """Translate what the file system raises into NotFoundError / StoreUnavailableError."""
        try:
            yield
        except (OctacloudError, InvalidSpecError):
            raise
        except FileNotFoundError:
            if not self.local:
                self._raise_if_bucket_missing()
            what = f"model {model!r}" if not path else f"{path!r} of model {model!r}"
            raise NotFoundError(f"{what} is not in the model storage {self.url}") from None
        except PermissionError as exc:
            source = f" from {self.options.source}" if self.options.source else ""
            raise StoreUnavailableError(self._why(
                f"the credentials{source} were refused ({_first(exc)}): check AWS_ACCESS_KEY_ID/"
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or --storage-credentials"
            )) from None  # fmt: skip
        except _transport_errors() as exc:  # connection refused, timeouts, 5xx, the SDK's own errors
            raise StoreUnavailableError(self._why(f"cannot read it: {type(exc).__name__}: {_first(exc)}")) from None

    def _raise_if_bucket_missing(self) -> None:
        bucket = self.root.split("/", 1)[0]
        try:
            exists = self.fs.exists(bucket)
        except Exception:
            return
        if not exists:
            raise StoreUnavailableError(self._why(f"the bucket {bucket!r} does not exist: create it, or fix the URL"))


def _transport_errors() -> tuple[type[BaseException], ...]:
    """What a file system raises when its store does not answer as it should (not our bugs: those propagate)."""
    kinds: list[type[BaseException]] = [OSError, TimeoutError]
    with contextlib.suppress(ImportError):
        from botocore.exceptions import BotoCoreError, ClientError

        kinds += [BotoCoreError, ClientError]
    with contextlib.suppress(ImportError):
        from aiohttp import ClientError as HttpClientError

        kinds.append(HttpClientError)
    return tuple(kinds)


def _marker(info: Mapping[str, Any]) -> str | None:
    for key in ("ETag", "etag", "md5Hash", "md5", "mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(key)
        if value is not None:
            return str(value)
    return None


def _first(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]
