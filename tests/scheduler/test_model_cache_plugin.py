"""Cache-aware placement: the ``model-cache`` term prefers nodes that hold the request's model, as much as its
weight says against the packing terms, and is neutral where it knows nothing."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from octacloud.core.model import Placement
from octacloud.scheduler.framework import ClusterState, Scheduler
from octacloud.scheduler.profiles import load_profile
from octacloud.scheduler.registry import PluginContext
from tests.scheduler.helpers import node, req


class Held:
    def __init__(self, held: dict[str, set[str]]) -> None:
        self.held = held

    def holds(self, node: str, model: str) -> bool:
        return model in self.held.get(node, set())


def _scheduler(tmp_path: Path, cache_weight: float, view: Held | None) -> Scheduler:
    path = tmp_path / "p.yaml"
    path.write_text(
        "plugins:\n  - resource-fit\n  - {plugin: gpu-packing, weight: 1}\n"
        f"  - {{plugin: model-cache, weight: {cache_weight}}}\n"
    )
    profile = load_profile(path, context=PluginContext(model_cache=view))
    scheduler = Scheduler(ClusterState([node("a", 2), node("b", 2)]), profile)
    scheduler.commit(req("busy", 500), Placement("busy", "a", (0,), 500))  # packing prefers a
    return scheduler


@pytest.mark.parametrize(
    ("weight", "model", "held", "chosen"),
    [
        (0, "m", {"b": {"m"}}, "a"),  # off: packing alone decides
        (10, "m", {"b": {"m"}}, "b"),  # heavy: the warm node wins over packing
        (10, "m", {"a": {"m"}}, "a"),  # warm and packed agree
        (10, "other", {"b": {"m"}}, "a"),  # nobody holds it: packing decides
        (10, "", {"b": {"m"}}, "a"),  # a request without a model: neutral
    ],
)
def test_the_node_that_holds_the_model_wins_by_its_weight(
    tmp_path: Path, weight: float, model: str, held: dict[str, set[str]], chosen: str
) -> None:
    scheduler = _scheduler(tmp_path, weight, Held(held))
    decision = scheduler.schedule(dataclasses.replace(req("r", 250), model=model))
    assert decision.placement is not None and decision.placement.node == chosen


def test_without_a_cache_view_the_term_is_neutral(tmp_path: Path) -> None:
    decision = _scheduler(tmp_path, 10, None).schedule(dataclasses.replace(req("r", 250), model="m"))
    assert decision.placement is not None and decision.placement.node == "a"
