"""What the meter reads from the running cloud (:class:`octacloud.metering.UsageSource`).

- slices: the scheduler's allocations (a replica's milli-GPU on its cards, the cards' model);
- power: each card's draw as the telemetry sampler last measured it (NVML), for the energy of each slice;
- traffic: the gateway's per-(calling tenant, deployment) counters;
- work: each replica's own Triton counters, scraped from its metrics endpoint
  (``nv_inference_compute_infer_duration_us``, ``nv_inference_count``): the execution-time share of a shared
  card, measured where the work runs;
- storage: the bytes of each deployment's model as the model store reports them (re-measured at most every
  minute, in the meter's worker thread; a folder store's files are walked, counting at most :data:`MAX_FILES`).
"""

from __future__ import annotations

import logging
import os
import re
import ssl
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from octacloud.control.controller import Controller
from octacloud.control.deployments import ReplicaState
from octacloud.core.errors import NotFoundError
from octacloud.gateway.upstream import UpstreamPool
from octacloud.metering import Allocation, Stored, Traffic, Work
from octacloud.observability.replicas import bounded_gather
from octacloud.security.internal_auth import REPLICA_HEADER_BYTES
from octacloud.security.internal_tls import replica_server_name
from octacloud.storage.store import FsspecStore, StoreUnavailableError

log = logging.getLogger("octacloud.metering")

EXEC_METRIC = "nv_inference_compute_infer_duration_us"
COUNT_METRIC = "nv_inference_count"
_REPLICA_SUFFIX = re.compile(r"-[0-9a-f]{6}$")


def deployment_of(replica_id: str) -> str:
    """Replica ids are ``<deployment>-<6 hex digits>``."""
    return _REPLICA_SUFFIX.sub("", replica_id)


def parse_work(text: str) -> tuple[int, int]:
    """(execution µs, inferences) summed over the models in a Prometheus text exposition.

    Only the two families' sample lines are read (``name{labels} value [timestamp]``; the value follows the
    labels' closing brace): a full parse of every family, once per replica at each close, cost more than the
    scrapes themselves at a thousand replicas. A sample line of theirs whose value is not a finite number raises
    ValueError."""
    sums = {EXEC_METRIC: 0, COUNT_METRIC: 0}
    for line in text.splitlines():
        name, brace, rest = line.partition("{")
        if not brace:
            name, _, rest = line.partition(" ")
        else:
            rest = rest.rpartition("}")[2]
        name = name.strip()
        if name not in sums:
            continue
        try:
            sums[name] += int(float(rest.split()[0]))
        except (IndexError, ValueError, OverflowError) as exc:
            raise ValueError(f"unreadable {name} sample: {line!r}") from exc
    return sums[EXEC_METRIC], sums[COUNT_METRIC]


MAX_FILES = 100_000
"""Storage measurement stops counting a folder after this many entries (a model folder has a handful)."""


def folder_bytes(path: Path, max_files: int = MAX_FILES) -> int:
    """Bytes of the files under ``path`` (links not followed), counting at most ``max_files`` entries.
    Blocking: the meter calls it from a worker thread."""
    total = seen = 0
    for root, dirs, files in os.walk(path, followlinks=False):
        for name in files:
            seen += 1
            if seen > max_files:
                log.warning("storage of %s: more than %d files; counted the first %d", path, max_files, max_files)
                return total
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
        seen += len(dirs)
    return total


class ClusterUsage:
    """The running cloud as a usage source. ``now`` is for the storage cache only."""

    def __init__(
        self,
        controller: Controller,
        scrape_timeout_s: float = 1.0,
        storage_ttl_s: float = 60.0,
        now: Callable[[], float] = time.monotonic,
        gpu_use: Callable[[], Mapping[str, int]] | None = None,
        card_power: Callable[[], Mapping[tuple[str, int], float]] | None = None,
        replica_headers: dict[str, str] | None = None,
        replica_tls: ssl.SSLContext | None = None,
    ) -> None:
        self.replica_tls = replica_tls
        """Internal TLS: scrapes are HTTPS, the replica's certificate checked against the cloud CA."""
        self.controller = controller
        self._gpu_use = gpu_use
        self._card_power = card_power
        self.replica_headers = replica_headers
        """Sent with every scrape of a replica (the cloud's internal secret)."""
        self.scrape_timeout_s = scrape_timeout_s
        self.storage_ttl_s = storage_ttl_s
        self._now = now
        self._sizes: dict[str, tuple[float, int]] = {}
        self._pool: UpstreamPool | None = None

    def allocations(self) -> list[Allocation]:
        state = self.controller.scheduler.state
        out = []
        for a in state:
            node = state.nodes[state.node_index(a.placement.node)]
            models = {g.index: g.model for g in node.gpus}
            model = models.get(a.placement.gpus[0], node.gpu_model) if a.placement.gpus else node.gpu_model
            milli = a.placement.milli_per_gpu * len(a.placement.gpus)
            out.append(
                Allocation(
                    a.request.owner,
                    deployment_of(a.request.name),
                    a.request.name,
                    model,
                    milli,
                    a.placement.node,
                    tuple(a.placement.gpus),
                )
            )
        return out

    def traffic(self) -> Mapping[tuple[str, str], Traffic]:
        return {key: t.copy() for key, t in self.controller.routes.traffic.items()}

    async def work(self) -> Mapping[str, Work]:
        if self._pool is None:  # the gateway's own HTTP/1.1 pool: httpx's per-request cost, a thousand times over
            self._pool = UpstreamPool(max_idle_per_host=1, connect_timeout=self.scrape_timeout_s, tls=self.replica_tls)
        pool = self._pool
        headers = [(k.lower().encode(), v.encode()) for k, v in (self.replica_headers or {}).items()]
        owners = {a.replica: a for a in self.allocations()}
        live = [
            r
            for r in self.controller.store.replicas()
            if r.state in (ReplicaState.READY, ReplicaState.STARTING) and r.metrics_port and r.id in owners
        ]
        texts = await bounded_gather(  # (a fleet's worth at once is quadratic)
            pool.request(
                getattr(r, "host", "") or "127.0.0.1",
                r.metrics_port or 0,
                b"GET",
                b"/metrics",
                [*headers, (REPLICA_HEADER_BYTES, r.id.encode())],  # another replica at a dead one's port: 421
                b"",
                self.scrape_timeout_s,
                server_name=replica_server_name(r.id) if pool.tls is not None else None,
            )
            for r in live
        )
        out: dict[str, Work] = {}
        for r, response in zip(live, texts, strict=True):
            if isinstance(response, BaseException) or response.status != 200:
                continue  # unreachable now: its counters are read at a later close (they are cumulative)
            try:
                exec_us, inferences = parse_work(response.body.decode("utf-8", "replace"))
            except ValueError:
                log.warning("replica %s: unreadable metrics", r.id)
                continue
            a = owners[r.id]
            out[r.id] = Work(a.tenant, a.deployment, a.gpu_model, exec_us, inferences)
        return out

    def gpu_use(self) -> Mapping[str, int]:
        """What the telemetry sampler measured through NVML (nothing on a host without NVIDIA cards)."""
        return self._gpu_use() if self._gpu_use is not None else {}

    def card_power(self) -> Mapping[tuple[str, int], float]:
        """Each card's draw the telemetry sampler measured (nothing on a host without NVIDIA cards)."""
        return self._card_power() if self._card_power is not None else {}

    def storage(self) -> list[Stored]:
        out = []
        now = self._now()
        for d in self.controller.store.deployments():
            cached = self._sizes.get(d.spec.model)
            if cached is None or now - cached[0] > self.storage_ttl_s:
                cached = self._sizes[d.spec.model] = (now, self._stored_bytes(d.spec.model))
            out.append(Stored(d.spec.tenant, d.spec.name, cached[1]))
        return out

    def _stored_bytes(self, model: str) -> int:
        """What the model store reports ``model`` takes (a folder store: its files, walked as before); a store
        that cannot be read now keeps the last size measured."""
        store = self.controller.models
        if isinstance(store, FsspecStore) and store.local:
            return folder_bytes(Path(store.root) / model)
        try:
            return store.size(model)
        except (StoreUnavailableError, NotFoundError) as exc:
            log.warning("storage of %s: %s", model, exc)
            return self._sizes.get(model, (0.0, 0))[1]

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None
