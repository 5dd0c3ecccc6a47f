"""Generated fleets (``octacloud fleet generate``) and the emulated runtime, without a cloud."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from octacloud.cli.main import app
from octacloud.control.emulated import handle_of, parse_handle
from octacloud.control.fleet import load_fleet_file
from octacloud.control.fleet_gen import FleetShape, generated_fleet
from octacloud.core.domains import domain_of
from octacloud.core.errors import InvalidSpecError
from octacloud.serving.emulated import EmulatedLatency, EmulatedRuntime
from octacloud.serving.types import TensorMetadata


def test_a_thousand_cards_in_racks_and_mixed_models() -> None:
    nodes = generated_fleet(FleetShape(nodes=125, cards=8, racks=5, zones=2))
    assert len(nodes) == 125 and sum(n.gpu_count for n in nodes) == 1000
    assert len({n.name for n in nodes}) == 125
    assert Counter(domain_of(n, "rack") for n in nodes) == {f"r{k:02d}": 25 for k in range(5)}
    assert set(Counter(domain_of(n, "zone") for n in nodes)) == {"z0", "z1"}  # domains, not bare labels
    assert Counter(n.gpu_model for n in nodes) == {"H100": 32, "A100": 31, "L40S": 31, "T4": 31}


def test_the_cli_writes_a_fleet_file_that_loads(tmp_path: Path) -> None:
    out = tmp_path / "fleet.yaml"
    result = CliRunner().invoke(app, ["fleet", "generate", "--nodes", "6", "--cards", "4", "--racks", "2",
                                      "--model", "A100:81920", "--out", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    nodes = load_fleet_file(out)
    assert [n.name for n in nodes][:4] == ["r00-n00", "r00-n01", "r00-n02", "r01-n00"]
    assert {n.gpu_model for n in nodes} == {"A100"} and all(n.gpu_count == 4 for n in nodes)
    first = yaml.safe_load(out.read_text())["nodes"][0]
    assert (first["zone"], first["rack"]) == ("z0", "r00") and "labels" not in first


@pytest.mark.parametrize(
    ("shape", "says"),
    [
        ({"nodes": 0}, "nodes ≥ 1"),
        ({"nodes": 3, "racks": 4}, "at most one rack per node"),
        ({"racks": 2, "zones": 3}, "at most one zone per rack"),
        ({"models": ("A100",)}, "NAME:MiB"),
        ({"models": ("A100:lots",)}, "NAME:MiB"),
    ],
)
def test_a_bad_shape_is_refused_naming_what(shape: dict[str, object], says: str) -> None:
    with pytest.raises(InvalidSpecError, match=says):
        FleetShape(**shape)  # type: ignore[arg-type]


def test_the_cli_refuses_a_bad_model() -> None:
    result = CliRunner().invoke(app, ["fleet", "generate", "--model", "A100"])
    assert result.exit_code == 2 and "NAME:MiB" in result.output


def test_the_emulated_runtime_answers_zeros_of_the_declared_shapes() -> None:
    runtime = EmulatedRuntime(
        [TensorMetadata("INPUT0", "FP32", (-1, 4))],
        [TensorMetadata("OUTPUT0", "FP32", (-1, 3)), TensorMetadata("LABEL", "BYTES", (-1, 1))],
        EmulatedLatency(0.0),
    )
    out = runtime.run({"INPUT0": np.ones((5, 4), np.float32)}, ["OUTPUT0", "LABEL"])
    assert out["OUTPUT0"].shape == (5, 3) and not out["OUTPUT0"].any()
    assert out["LABEL"].shape == (5, 1) and out["LABEL"][0, 0] == b""
    with pytest.raises(ValueError, match="≥ 0"):
        EmulatedLatency(-1.0)


def test_handles_name_their_host_and_replica() -> None:
    assert parse_handle(handle_of("h3", "mlp-abc123")) == ("h3", "mlp-abc123")
    with pytest.raises(InvalidSpecError, match="emulated replica"):
        parse_handle("12345")
