"""Losing a rack of a Ray cluster under traffic: the cluster, the deployments and the ordered record that
``tests/ray/test_rack_loss.py`` checks and ``bench/rack_loss_ray.py`` times.

Four Ray nodes in two racks (``r1``: ``rack-a1``, ``rack-a2``; ``r2``: ``rack-b1``, ``rack-b2``), each one CPU
"card" and one core, declared as an operator declares them (the fleet file's ``rack``, advertised as the Ray
label ``octacloud.io/rack``), behind a head node of their own that is no octacloud node (the cluster's GCS
survives the rack). One deployment of two replicas (``pair``) and one of one (``single``), both the MLP.

A :class:`Record` holds, in the order they happened, every request's outcome of the client threads (one per
deployment), the kill and every event the controller stores; the checks read the order, the bench reads the
clocks stamped beside it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from octacloud.control.fleet import CPU_CARD_MODEL
from octacloud.core import Gpu, Node

from .harness import CloudThread

RACKS = {"r1": ("rack-a1", "rack-a2"), "r2": ("rack-b1", "rack-b2")}
RACK_OF = {node: rack for rack, nodes in RACKS.items() for node in nodes}
PAIR, SINGLE = "pair", "single"
COUNTS = {PAIR: 2, SINGLE: 1}
MODEL = "mlp"
SAMPLE = [0.01 * i for i in range(256)]  # the MLP takes 256 floats


def rack_nodes() -> list[Node]:
    """The four servers, each in its rack."""
    return [Node(name, 1000, 4096, (Gpu(0, CPU_CARD_MODEL, 4096),), labels={"rack": RACK_OF[name]}) for name in RACK_OF]


def model_repository(root: Path, models: Path) -> Path:
    """A repository holding only the MLP of the example models at ``models`` (linked, not copied)."""
    repo = root / "repository"
    repo.mkdir(parents=True, exist_ok=True)
    os.symlink((models / MODEL).resolve(), repo / MODEL)
    return repo


def deploy(cloud: CloudThread) -> None:
    """Both deployments, 2 octants a replica; returns once every replica serves (a deadline against a hang)."""
    for name, count in COUNTS.items():
        body = {"name": name, "model": MODEL, "octants": 2, "min_replicas": count, "max_replicas": count}
        created = cloud.admin("POST", "/deployments", body)
        assert created.status_code == 201, created.text
    deadline = time.monotonic() + 180
    while not at_count(cloud):
        if time.monotonic() > deadline:
            raise AssertionError(f"replicas not ready after 180 s: {[cloud.deployment(n) for n in COUNTS]}")
        time.sleep(0.2)


def at_count(cloud: CloudThread, avoid: tuple[str, ...] = ()) -> bool:
    """Every deployment has its count of ready replicas, none on the nodes ``avoid``."""
    for name, count in COUNTS.items():
        ready = cloud.ready(name)
        if len(ready) != count or any(r["node"] in avoid for r in ready):
            return False
    return True


@dataclass(frozen=True, slots=True)
class Entry:
    what: str
    """``ok`` or ``failed`` (a request), ``kill``, ``event`` (the controller's), ``back`` (all at count)."""
    detail: str
    at: float
    """``time.monotonic()`` when it was recorded (the bench's clock; the checks read the order)."""
    deployment: str = ""
    """A request's deployment."""


@dataclass(slots=True)
class Record:
    entries: list[Entry] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, what: str, detail: str = "", deployment: str = "") -> None:
        with self.lock:
            self.entries.append(Entry(what, detail, time.monotonic(), deployment))

    def listen(self, event: dict[str, object]) -> None:
        """A store subscriber: the controller's events, as they are stored."""
        self.add("event", f"{event['kind']} {event['subject']} {event['message']}")

    def snapshot(self) -> list[Entry]:
        with self.lock:
            return list(self.entries)


class Traffic:
    """One client sending ``deployment`` one request after the other through the gateway, each outcome recorded
    in order (``ok`` with the right shape of answer, else ``failed`` with the status or the error)."""

    def __init__(self, cloud: CloudThread, record: Record, deployment: str = PAIR) -> None:
        self.deployment = deployment
        self.url = f"{cloud.url}/v2/models/{deployment}/infer"
        self.headers = {**cloud.headers, "content-type": "application/json"}
        self.body = json.dumps(
            {"inputs": [{"name": "input", "shape": [1, 256], "datatype": "FP32", "data": SAMPLE}]}
        ).encode()
        self.record = record
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Traffic:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "a request hung"

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.done.is_set():
                what, detail = self._one(client)
                self.record.add(what, detail, self.deployment)
                if what == "failed":
                    self.done.wait(0.05)  # as a client would back off (the answer says retry after 1 s)

    def _one(self, client: httpx.Client) -> tuple[str, str]:
        try:
            answer = client.post(self.url, content=self.body, headers=self.headers)
        except httpx.HTTPError as exc:
            return "failed", f"{type(exc).__name__}: {exc}"
        if answer.status_code != 200:
            return "failed", f"{answer.status_code}: {answer.text[:200]}"
        outputs = answer.json().get("outputs", [])
        if not outputs or outputs[0].get("shape") != [1, 10]:
            return "failed", f"unexpected answer: {answer.text[:200]}"
        return "ok", ""


def wait_for(what: str, predicate: Callable[[], bool], timeout: float) -> None:
    """A deadline against a hang (what is checked is the order of events, not how long they took)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout:g} s")
        time.sleep(0.1)


def oks_after(record: Record, what: str | None, count: int, deployment: str = PAIR) -> Callable[[], bool]:
    """Whether ``count`` requests to ``deployment`` succeeded after the last ``what`` entry (None: since the
    start)."""

    def check() -> bool:
        entries = record.snapshot()
        last = 0 if what is None else max((i for i, e in enumerate(entries) if e.what == what), default=None)
        return last is not None and sum(e.what == "ok" and e.deployment == deployment for e in entries[last:]) >= count

    return check


def cards_given_twice(cloud: CloudThread) -> list[str]:
    """Cards whose allocations add up past a whole card, and replicas that serve elsewhere than allocated."""
    state = cloud.cloud.state
    held: dict[tuple[str, int], int] = {}
    for a in state.allocations.values():
        for gpu in a.placement.gpus:
            key = (a.placement.node, gpu)
            held[key] = held.get(key, 0) + a.placement.milli_per_gpu
    wrong = [f"{node}/gpu{gpu}: {milli} milli" for (node, gpu), milli in sorted(held.items()) if milli > 1000]
    for r in cloud.cloud.store.replicas():
        placed: Any = state.allocations.get(r.id)
        if r.state.value == "ready" and (placed is None or (placed.placement.node, placed.placement.gpus) != (
            r.node, r.gpus)):  # fmt: skip
            wrong.append(f"{r.id} serves on {r.node} {r.gpus}, allocated {placed}")
    return wrong
