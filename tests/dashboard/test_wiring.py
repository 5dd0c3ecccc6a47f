"""The cloud wires monitoring in: the sampler (with the gateway's measured round trips, and this host's NIC load for
the local launcher's nodes) is every profile's telemetry source; /metrics and /dashboard exist."""

from __future__ import annotations

from pathlib import Path

from octacloud.app import Cloud, CloudConfig
from octacloud.control.fleet import CPU_CARD_MODEL
from octacloud.core import Gpu, Node
from octacloud.observability.nic import HostNetFiles
from octacloud.scheduler.plugins.telemetry import TelemetryScore
from octacloud.scheduler.telemetry import MeasuredNetwork, PricedTelemetry

from .conftest import write_models

NODES = [Node("node-a", 8000, 65536, tuple(Gpu(i, CPU_CARD_MODEL, 4096) for i in range(2)))]


def test_telemetry_terms_of_the_profile_read_the_cloud_sampler(tmp_path: Path) -> None:
    config = CloudConfig(repository=write_models(tmp_path / "models"), state_dir=tmp_path / "var",
                         policy="multi-objective", telemetry_interval_s=0.25)  # fmt: skip
    cloud = Cloud(config, nodes=NODES)
    try:
        terms = [p for p in cloud.scheduler.profile.plugins() if isinstance(p, TelemetryScore)]
        assert {t.metric for t in terms} >= {"gpu_utilisation", "gpu_memory_bandwidth", "pcie_throughput"}
        # through the fleet's tariffs (power_price, power_cost) and the gateway's measured round trips
        # (network_latency_us), on the cloud's sampler
        sources = [t.source.source for t in terms if isinstance(t.source, PricedTelemetry)]
        assert len(sources) == len(terms) and all(isinstance(s, MeasuredNetwork) for s in sources)
        assert all(t.source is cloud.node_inputs for t in terms)  # the snapshot /metrics shows as octacloud_node_*
        assert all(s.source is cloud.monitoring.sampler for s in sources)  # type: ignore[attr-defined]
        assert sources[0].latency == cloud.route_latency.node_latency_us  # type: ignore[attr-defined]
        assert cloud.monitoring.sampler.interval_s == 0.25
        assert cloud.monitoring.sampler.nvml is None  # a fleet of CPU cards: no NVML, no DCGM names
        nic = cloud.monitoring.sampler.nic  # the local launcher runs every node here: this host's NICs are theirs
        assert nic is not None and isinstance(nic.files, HostNetFiles)
        assert cloud.rest_gateway.dashboard is not None and cloud.rest_gateway.metrics is not None
    finally:
        cloud.store.close()


class RemoteLauncher:
    """Stands in for a launcher whose nodes are other hosts (Ray's): the cloud never calls it here."""

    def launch(self, spec: object) -> None:
        raise AssertionError("nothing is launched")


def test_nodes_of_another_launcher_get_no_nic_load_of_this_host(tmp_path: Path) -> None:
    config = CloudConfig(repository=write_models(tmp_path / "models"), state_dir=tmp_path / "var",
                         policy="multi-objective")  # fmt: skip
    cloud = Cloud(config, nodes=NODES, launcher=RemoteLauncher())  # type: ignore[arg-type]
    try:
        assert cloud.monitoring.sampler.nic is None
    finally:
        cloud.store.close()
