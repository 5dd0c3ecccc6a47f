"""Probes and model footprints: the controller's I/O towards replicas and the repository."""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Callable
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from octacloud.control.controller.contracts import Probe
from octacloud.control.deployments import Replica
from octacloud.control.sizing import ModelFootprint
from octacloud.core.errors import InvalidSpecError, NotFoundError
from octacloud.gateway.upstream import UpstreamError, UpstreamPool
from octacloud.security.internal_auth import REPLICA_HEADER_BYTES
from octacloud.security.internal_tls import replica_server_name
from octacloud.serving.errors import ModelConfigError
from octacloud.serving.generate.args import ENGINE_ARGS_FILE, EngineArgs, ModelShape, is_generative
from octacloud.storage.store import MANIFEST_FILE, FsspecStore, ModelStore, StoreUnavailableError


class HttpProber:
    """Readiness through the replica's own OIP endpoint: ``GET /v2/models/<model>/ready``. A replica that answers
    but whose model is not ready is asked for its repository index: a model that failed to load is reported
    there as UNAVAILABLE with a reason, which makes the probe's answer final (no wait for the start-up timeout)."""

    def __init__(
        self,
        pool: UpstreamPool | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
        on_ready: Callable[[str], None] | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.pool = pool or UpstreamPool(max_idle_per_host=2, connect_timeout=1.0, tls=tls)
        """With internal TLS the probe checks the replica's certificate names the replica it expects."""
        self.headers = headers or []
        """Sent with every probe (the cloud's internal secret)."""
        self.on_ready = on_ready
        """Called with the id of each replica a probe found ready (the gateway ends its ejection)."""

    async def probe(self, replica: Replica, model: str, timeout: float) -> Probe:
        if not replica.http_port:
            return Probe(False)
        host = replica.host or "127.0.0.1"
        name = replica_server_name(replica.id) if self.pool.tls is not None else None
        named = [*self.headers, (REPLICA_HEADER_BYTES, replica.id.encode())]  # another process at the address: 421
        try:
            path = f"/v2/models/{model}/ready".encode()
            response = await self.pool.request(
                host, replica.http_port, b"GET", path, named, b"", timeout, server_name=name
            )
            if response.status == 200:
                if self.on_ready is not None:
                    self.on_ready(replica.id)
                return Probe(True)
            if response.status == 421:
                return Probe(False)
            headers = [(b"content-type", b"application/json"), *named]
            index = await self.pool.request(
                host, replica.http_port, b"POST", b"/v2/repository/index", headers, b"{}", timeout, server_name=name
            )
        except (UpstreamError, TimeoutError, OSError):
            return Probe(False)
        return Probe(False, _load_failure(index.status, index.body, model))

    async def close(self) -> None:
        """Close the probe connections kept alive to replicas."""
        await self.pool.close()


class RepositoryFootprints:
    """A model's footprint from the model store: ``config.pbtxt`` parameters written by the toolchain
    (``octacloud.weights_bytes``, ``octacloud.bytes_per_sample``), ``max_batch_size``, and the newest
    version's ``profile.json``; without them, the size of the newest version's files stands for the weights.
    ``repository`` is the store, or a folder (a store of its own)."""

    def __init__(
        self, repository: Path | ModelStore, *, ttl_s: float = 10.0, now: Callable[[], float] = time.monotonic
    ) -> None:
        self.store: ModelStore = FsspecStore(str(repository)) if isinstance(repository, Path) else repository
        self.ttl_s = ttl_s
        """A footprint read is reused this long (the controller asks for it on every pass)."""
        self._now = now
        self._known: dict[str, tuple[float, ModelFootprint]] = {}

    def __call__(self, model: str) -> ModelFootprint:
        """The footprint of ``model``; while the store cannot be read, the last one read, or NotFoundError (a
        store that goes away never stops the controller's loop: it places replicas without a footprint)."""
        now = self._now()
        known = self._known.get(model)
        if known is not None and now - known[0] < self.ttl_s:
            return known[1]
        try:
            footprint = self._read(model)
        except StoreUnavailableError as exc:
            if known is None:  # what callers already take as "no footprint known": they place without one
                raise NotFoundError(f"the footprint of {model!r} is unknown: {exc}") from None
            return known[1]
        self._known[model] = (now, footprint)
        return footprint

    def _read(self, model: str) -> ModelFootprint:
        store = self.store
        versions = store.versions(model)  # NotFoundError: not in the store
        if not versions:
            raise NotFoundError(f"model {model!r} has no version folders in the model storage {store.url}")
        config = model_config_pb2.ModelConfig()
        try:
            text_format.Parse(store.read(model, "config.pbtxt").decode("utf-8", "replace"), config)
        except NotFoundError:
            pass
        except text_format.ParseError as exc:
            raise InvalidSpecError(f"{store.url}/{model}/config.pbtxt: {exc}") from None
        if is_generative(config):
            return _generative_footprint(config, store, model, versions[-1])
        params = {k: v.string_value for k, v in config.parameters.items()}
        weights = _int(params.get("octacloud.weights_bytes"))
        if weights is None:
            weights = sum(f.size for rel, f in store.files(model, versions[-1]).items() if rel != MANIFEST_FILE)
        per_sample = _int(params.get("octacloud.bytes_per_sample")) or 0
        try:
            throughput = _profile_throughput(store.read(model, f"{versions[-1]}/profile.json"))
        except NotFoundError:
            throughput = None
        return ModelFootprint(weights, per_sample, max(1, config.max_batch_size), throughput)


def _generative_footprint(
    config: model_config_pb2.ModelConfig, store: ModelStore, model: str, version: int
) -> ModelFootprint:
    """Weights and compute buffers, plus the KV cache of ``parallel`` sequences of ``context_length`` (the engine
    allocates it whole when it starts), from the config's GGUF parameters and the version's engine arguments."""
    where = f"{store.url}/{model}/{version}/{ENGINE_ARGS_FILE}"
    try:
        try:
            raw = json.loads(store.read(model, f"{version}/{ENGINE_ARGS_FILE}"))
        except NotFoundError:
            raw = {}
        except ValueError as exc:
            raise ModelConfigError(f"{where} is not JSON: {exc}") from None
        args = EngineArgs.parse(raw, where)
        shape = ModelShape.of(config)
    except ModelConfigError as exc:
        raise InvalidSpecError(f"model {config.name!r}: {exc}") from None
    fixed = shape.weights_bytes + args.compute_bytes(shape) + args.cache_ram_mib * 2**20
    per_sequence = args.kv_bytes_per_token(shape) * args.context_length
    return ModelFootprint(fixed, per_sequence, args.parallel, sequence_tokens=args.context_length)


def _load_failure(status: int, body: bytes, model: str) -> str:
    """The reason ``model`` failed to load, from a repository index answer ('' when it did not fail)."""
    if status != 200:
        return ""
    try:
        entries = json.loads(body)
    except ValueError:
        return ""
    for e in entries if isinstance(entries, list) else []:
        if isinstance(e, dict) and e.get("name") == model and e.get("state") == "UNAVAILABLE" and e.get("reason"):
            return str(e["reason"])[:500]
    return ""


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value else None
    except ValueError:
        return None


def _profile_throughput(text: bytes) -> float | None:
    """Best samples/s in a toolchain profile, if there is one (any layout with a list of batch points)."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    best = None
    points = data.get("batches") or data.get("points") or data.get("throughput") or []
    if isinstance(points, list):
        for p in points:
            if isinstance(p, dict):
                v = p.get("samples_per_s") or p.get("samples_per_second")
                if isinstance(v, int | float):
                    best = max(best or 0.0, float(v))
    return best
