"""End to end on a declared fleet: fragment a live cloud with a deploy/undeploy sequence, then deploy a replica
that fits nowhere; the controller's loop moves a running replica make-before-break and places it, while a
bounded client load runs. Then a rolling update of a one-replica deployment. Not one request fails."""

from __future__ import annotations

import dataclasses
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest

from octacloud.app import Cloud, CloudConfig
from octacloud.control.fleet import CPU_CARD_MODEL
from octacloud.core import Gpu, Node

from .conftest import IN
from .test_cloud_e2e import CloudThread, config, ready_ids, wait_until

pytestmark = pytest.mark.slow

FLEET = [Node(f"node-{x}", 8000, 65536, (Gpu(0, CPU_CARD_MODEL, 4096),)) for x in "ab"]
"""Two nodes of one card each: a replica moves to another node (defragmentation never moves within a node)."""


class TwoNodeCloud(CloudThread):
    async def _make(self, config: CloudConfig) -> Cloud:
        return Cloud(config, nodes=FLEET)


@dataclass
class Load:
    """Closed-loop clients through the gateway; each result is (start time, ok, latency seconds, deployment)."""

    url: str
    key: str
    deployments: list[str]
    results: list[tuple[float, bool, float, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for name in self.deployments:
            t = threading.Thread(target=self._client, args=(name,), daemon=True)
            t.start()
            self.threads.append(t)

    def _client(self, name: str) -> None:
        x = np.random.default_rng(1).standard_normal((1, IN)).astype(np.float32)
        body = {"inputs": [{"name": "INPUT0", "shape": [1, IN], "datatype": "FP32", "data": x.ravel().tolist()}]}
        headers = {"Authorization": f"Bearer {self.key}"}
        with httpx.Client(base_url=self.url, headers=headers, timeout=30) as client:
            while not self.stop.is_set():
                t0 = time.monotonic()
                try:
                    r = client.post(f"/v2/models/{name}/infer", json=body)
                    ok = r.status_code == 200
                    if not ok:
                        self.errors.append(f"{name}: {r.status_code} {r.text[:200]}")
                except httpx.HTTPError as exc:
                    ok = False
                    self.errors.append(f"{name}: {exc}")
                self.results.append((t0, ok, time.monotonic() - t0, name))
                time.sleep(0.01)  # bounded: about 50-100 requests per second per client here

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=35)

    def window(self, start: float, end: float) -> tuple[int, int, float]:
        """(sent, failed, p99 ms) of requests started in [start, end)."""
        rows = [r for r in self.results if start <= r[0] < end]
        lat = sorted(r[2] for r in rows)
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1000 if lat else float("nan")
        return len(rows), sum(1 for r in rows if not r[1]), p99


def _placed(c: CloudThread) -> dict[str, tuple[str, str]]:
    return {
        r["id"]: (d["spec"]["name"], r["node"])
        for d in c.admin("GET", "/deployments").json()["deployments"]
        for r in d["instances"]
        if r["gpus"]
    }


def test_defragmentation_and_rolling_update_under_load(tmp_path: Path, linear_repo: Path) -> None:
    shutil.copytree(linear_repo / "linear", linear_repo / "linear2")  # the same model under another name
    (linear_repo / "linear2" / "config.pbtxt").write_text(
        (linear_repo / "linear" / "config.pbtxt").read_text().replace('name: "linear"', 'name: "linear2"')
    )
    # Two cards filled to the last octant: the product's 20 % failover reserve is switched off for this fleet
    # (16 octants hold no whole-card replica next to two half-card ones under it); best fit packs predictably.
    profile = tmp_path / "profile.yaml"
    profile.write_text(
        "name: e2e-defrag\ndescription: best fit, no failover reserve\nplugins:\n"
        "  - plugin: failover-headroom\n    args: {percent: 0}\n  - resource-fit\n  - plugin: bestfit\n    weight: 1\n"
    )
    c = TwoNodeCloud(dataclasses.replace(config(tmp_path, linear_repo), policy=str(profile)))
    load: Load | None = None
    try:
        # fragment: four half-card replicas fill both cards, then one leaves each card
        for name in ("p", "q", "r", "s"):
            created = c.admin("POST", "/deployments", {"name": name, "model": "linear", "octants": 4})
            assert created.status_code == 201, created.text
            wait_until(f"{name} ready", lambda n=name: len(ready_ids(c, n)) == 1)  # type: ignore[misc]
        placed = _placed(c)
        by_card: dict[str, list[str]] = {}
        for deployment, card in placed.values():
            by_card.setdefault(card, []).append(deployment)
        assert sorted(len(v) for v in by_card.values()) == [2, 2], by_card
        leave = [sorted(v)[0] for v in by_card.values()]
        stay = [sorted(v)[1] for v in by_card.values()]
        for name in leave:
            assert c.admin("DELETE", f"/deployments/{name}").status_code == 200
        wait_until("the slices to return", lambda: c.cloud.state.allocated_gpu_milli == 1000)

        load = Load(c.url, c.key, stay)
        load.start()
        time.sleep(4.0)
        t_moves = time.monotonic()

        # a whole-card replica fits nowhere until a half-card one moves next to the other
        created = c.admin("POST", "/deployments", {"name": "big", "model": "linear", "octants": 8})
        assert created.status_code == 201, created.text
        wait_until("big ready after a move", lambda: len(ready_ids(c, "big")) == 1, timeout=120)
        t_moved = time.monotonic()
        assert c.cloud.controller.scheduling.defragmentation_moves >= 1
        kinds = [e["kind"] for e in c.admin("GET", "/events?limit=200").json()["events"]]
        assert "moving" in kinds and "moved" in kinds
        time.sleep(1.0)

        # a rolling update of a one-replica deployment (room: the big one leaves first)
        assert c.admin("DELETE", "/deployments/big").status_code == 200
        wait_until("big gone", lambda: c.cloud.state.allocated_gpu_milli == 1000)
        t_update = time.monotonic()
        target = stay[0]
        before = ready_ids(c, target)
        spec = {"name": target, "model": "linear2", "octants": 4}
        assert c.admin("POST", "/deployments", spec).status_code == 201
        wait_until(
            "the update to complete",
            lambda: c.admin("GET", f"/deployments/{target}/rollout").json()["complete"]
            and not ready_ids(c, target) & before,
            timeout=120,
        )
        rollout = c.admin("GET", f"/deployments/{target}/rollout").json()
        assert rollout["revision"] == 2 and rollout["model"] == "linear2"
        time.sleep(1.0)
        t_end = time.monotonic()
        load.close()

        rows = [
            ("before", *load.window(0.0, t_moves)),
            ("during moves", *load.window(t_moves, t_moved)),
            ("during rolling update", *load.window(t_update, t_end)),
        ]
        for what, sent, failed, p99 in rows:
            print(f"{what:>22}: sent {sent:5d}  failed {failed}  p99 {p99:7.1f} ms")
        assert not load.errors, load.errors[:5]
        assert all(sent > 0 and failed == 0 for _what, sent, failed, _p99 in rows)
        metrics = httpx.get(f"{c.url}/metrics", headers=c.auth, timeout=30).text
        moves = [line for line in metrics.splitlines() if line.startswith("octacloud_scheduler_defragmentation_moves")]
        print(moves)
        assert moves and float(moves[0].split()[-1]) > 0
    finally:
        if load is not None:
            load.close()
        c.stop(stop_replicas=True)
