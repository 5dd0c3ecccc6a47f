"""The operator's dashboard in a real browser: headless Debian Chromium (driven by Playwright, no browser
download) against a running cloud with two deployments of real replica processes.

It logs in with the admin key, checks that the card map shows exactly the controller's placements (every
replica's octants on its node and card, every free octant free), that per-deployment load and batch sizes
appear, and saves screenshots under ``out/screenshots/``. It also checks that every Prometheus endpoint (the
cloud's ``/metrics``, each replica's) parses with prometheus_client's official parser.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from octacloud.app import CloudConfig
from octacloud.control.controller import ControllerSettings
from octacloud.control.fleet import CPU_CARD_MODEL
from octacloud.core import Gpu, Node
from octacloud.security.internal_auth import HEADER

from .chromium import CHROMIUM, chromium_page
from .conftest import CloudThread, wait_until, write_models

pytestmark = pytest.mark.slow

SCREENSHOTS = Path(__file__).resolve().parents[2] / "out" / "screenshots"
FLEET = [
    Node("node-a", 8000, 65536, tuple(Gpu(i, CPU_CARD_MODEL, 4096) for i in range(2))),
    Node("node-b", 8000, 65536, tuple(Gpu(i, CPU_CARD_MODEL, 4096) for i in range(2))),
]
LOADED = """() => [...document.querySelectorAll('#deployments tbody tr')].filter(
    tr => tr.querySelector('.hist span') && !/^–/.test(tr.cells[5].textContent.trim())).length == 2"""
"""True once both deployments show a request rate and a batch-size histogram."""


@pytest.fixture
def cloud(tmp_path: Path) -> Iterator[CloudThread]:
    config = CloudConfig(
        repository=write_models(tmp_path / "models"),
        state_dir=tmp_path / "var",
        http_port=0,
        grpc_port=0,
        telemetry_interval_s=0.5,
        controller=ControllerSettings(interval_s=0.5, health_interval_s=0.2, backoff_base_s=0.2, stop_grace_s=3),
    )
    c = CloudThread(config, FLEET)
    yield c
    c.stop()


def infer(url: str, model: str, key: str, rows: int) -> None:
    x = np.random.default_rng(rows).standard_normal((rows, 16)).astype(np.float32)
    body = {"inputs": [{"name": "INPUT0", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    r = httpx.post(f"{url}/v2/models/{model}/infer", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 200, r.text


def deploy_two(cloud: CloudThread) -> None:
    for tenant in ("acme", "globex"):
        created = cloud.post("/admin/tenants", {"name": tenant})
        assert created.status_code == 201, created.text
    for body in (
        {"name": "linear", "model": "linear", "octants": 3, "min_replicas": 1, "max_replicas": 3, "tenant": "acme"},
        {"name": "ranker", "model": "ranker", "octants": 2, "min_replicas": 1, "max_replicas": 3, "tenant": "globex"},
    ):
        created = cloud.post("/admin/deployments", body)
        assert created.status_code == 201, created.text
    assert cloud.post("/admin/deployments/linear/scale", {"replicas": 3}).status_code == 200
    assert cloud.post("/admin/deployments/ranker/scale", {"replicas": 2}).status_code == 200

    def all_ready() -> bool:
        rows = cloud.get("/admin/deployments").json()["deployments"]
        return sum(1 for d in rows for r in d["instances"] if r["state"] == "ready") == 5

    wait_until("five ready replicas", all_ready, timeout=120)


def expected_cells(cloud: CloudThread) -> tuple[Counter[tuple[str, int, str]], Counter[tuple[str, int]]]:
    """From the admin API (the controller's placements): octants per (node, card, replica), free per card."""
    held: Counter[tuple[str, int, str]] = Counter()
    for d in cloud.get("/admin/deployments").json()["deployments"]:
        for r in d["instances"]:
            for g in r["gpus"]:
                held[(r["node"], g, r["id"])] += r["milli_per_gpu"] // 125
    free: Counter[tuple[str, int]] = Counter()
    for node in cloud.get("/admin/fleet").json()["nodes"]:
        for card in node["cards"]:
            free[(node["name"], card["index"])] = card["free_milli"] // 125
    return held, free


def test_dashboard_in_chromium_matches_placements(cloud: CloudThread) -> None:
    if not CHROMIUM.exists():
        pytest.fail("Debian's chromium is missing: run `make browser` (apt-get install chromium chromium-driver)")
    deploy_two(cloud)
    stop = threading.Event()

    def load() -> None:  # steady traffic of mixed batch sizes, so QPS, latency and batch histograms show
        k = 0
        while not stop.is_set():
            infer(cloud.url, "linear", cloud.key, 1 + k % 4)
            infer(cloud.url, "ranker", cloud.key, 1 + k % 2)
            k += 1

    worker = threading.Thread(target=load, daemon=True)
    worker.start()

    # the JSON API and /metrics need the admin key; the static page does not (it carries no data)
    assert httpx.get(f"{cloud.url}/dashboard/api/state", timeout=10).status_code == 401
    bad = {"Authorization": "Bearer oc_000000000000_" + "x" * 43}
    assert httpx.get(f"{cloud.url}/dashboard/api/state", headers=bad, timeout=10).status_code == 401
    assert httpx.get(f"{cloud.url}/metrics", timeout=10).status_code == 401
    assert httpx.get(f"{cloud.url}/dashboard/", timeout=10).status_code == 200

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    try:
        with chromium_page() as page:
            requests: list[str] = []
            page.on("request", lambda r: requests.append(r.url))
            page.goto(f"{cloud.url}/dashboard/")
            page.wait_for_selector("#login-form", state="visible")
            page.screenshot(path=str(SCREENSHOTS / "01-login.png"))
            page.fill("#login-key", cloud.key)
            page.click("#login-form button[type=submit]")
            page.wait_for_selector(".octant[data-replica]")

            # wait until the page has seen load: a QPS value and a batch-size histogram for both deployments
            page.wait_for_function(LOADED, timeout=60_000)
            page.wait_for_timeout(3000)  # a few more seconds of history for the charts
            held, free = expected_cells(cloud)
            cells: list[dict[str, Any]] = page.eval_on_selector_all(
                ".octant",
                "els => els.map(e => ({node: e.dataset.node, gpu: +e.dataset.gpu, replica: e.dataset.replica || null,"
                " deployment: e.dataset.deployment || null, tenant: e.dataset.tenant || null}))",
            )
            shown_held = Counter((c["node"], c["gpu"], c["replica"]) for c in cells if c["replica"])
            shown_free = Counter((c["node"], c["gpu"]) for c in cells if not c["replica"])
            assert shown_held == held
            assert shown_free == +free
            assert len(cells) == 8 * sum(len(n.gpus) for n in FLEET)
            tenants = {c["deployment"]: c["tenant"] for c in cells if c["replica"]}
            assert tenants == {"linear": "acme", "ranker": "globex"}
            page.screenshot(path=str(SCREENSHOTS / "02-dashboard.png"), full_page=True)
            page.locator("#fleet-section").screenshot(path=str(SCREENSHOTS / "03-card-map-by-deployment.png"))
            page.select_option("#colour-by", "tenant")
            page.locator("#fleet-section").screenshot(path=str(SCREENSHOTS / "04-card-map-by-tenant.png"))

            assert page.evaluate(LOADED), "the load figures vanished between polls"
            # the key never went into a URL
            assert not [u for u in requests if cloud.key in u]
            assert cloud.key not in page.url
    finally:
        stop.set()
        worker.join(timeout=30)


def test_every_prometheus_endpoint_parses(cloud: CloudThread) -> None:
    deploy_two(cloud)
    for k in range(1, 5):
        infer(cloud.url, "linear", cloud.key, k)
        infer(cloud.url, "ranker", cloud.key, k)

    def families() -> dict[str, Any]:
        text = cloud.get("/metrics").text
        return {f.name: f for f in text_string_to_metric_families(text)}

    cards = {(n.name, str(g.index)) for n in FLEET for g in n.gpus}

    def measured() -> bool:
        """Triton metrics re-exported, and every card's busy share known (a rate: two scrapes of its replicas)."""
        f = families()
        served = f.get("nv_inference_request_success")
        busy = f.get("octacloud_cpu_card_busy_ratio")
        return (
            served is not None
            and any(s.value > 0 for s in served.samples)
            and busy is not None
            and {(s.labels["node"], s.labels["gpu"]) for s in busy.samples} == cards
        )

    wait_until("the cloud to re-export the replicas' metrics and measure every card", measured, timeout=30)
    cloud_families = families()
    alloc = cloud_families["octacloud_scheduler_allocated_milli"].samples[0].value
    assert alloc == 3 * 375 + 2 * 250
    assert cloud_families["octacloud_scheduler_allocation_ratio"].samples[0].value == pytest.approx(alloc / 4000)
    busy = {
        (s.labels["node"], s.labels["gpu"]): s.value for s in cloud_families["octacloud_cpu_card_busy_ratio"].samples
    }
    idle = [(n["name"], str(c["index"])) for n in cloud.get("/admin/fleet").json()["nodes"] for c in n["cards"]
            if c["free_milli"] == 1000]  # fmt: skip
    assert idle and all(busy[card] == 0.0 for card in idle)  # nothing placed there: measurably idle
    assert not [name for name in cloud_families if name.startswith("DCGM_") and cloud_families[name].samples]
    served = {s.labels["model"] for s in cloud_families["nv_inference_request_success"].samples}
    assert served == {"linear", "ranker"}
    requests = {s.labels["deployment"]: s.value for s in cloud_families["octacloud_gateway_requests"].samples}
    assert requests["linear"] >= 4 and requests["ranker"] >= 4
    decisions = {s.labels["outcome"]: s.value for s in cloud_families["octacloud_scheduler_decisions"].samples}
    assert decisions["placed"] >= 5

    # `octacloud top` draws the same card map in the terminal: one cell per octant held
    from typer.testing import CliRunner

    from octacloud.cli.main import app
    from octacloud.cli.top import OCTANT

    result = CliRunner().invoke(app, ["top", "--once", "--url", cloud.url, "--key", cloud.key])
    assert result.exit_code == 0, result.output
    assert result.output.count(OCTANT) == 3 * 3 + 2 * 2
    assert "linear" in result.output and "ranker" in result.output and "node-b" in result.output
    refused = CliRunner().invoke(app, ["top", "--once", "--url", cloud.url, "--key", "oc_000000000000_" + "x" * 43])
    assert refused.exit_code == 1

    # every replica's own endpoint too (a replica the health checks restart under load moves to new ports:
    # read the ports again until all five answer; text that does not parse fails at once)
    texts: list[str] = []

    def replica_texts() -> bool:
        rows = [r for d in cloud.get("/admin/deployments").json()["deployments"] for r in d["instances"]]
        texts.clear()
        for r in rows:
            if r["state"] != "ready":
                return False
            try:
                url = f"http://127.0.0.1:{r['metrics_port']}/metrics"  # replicas answer their cloud only
                texts.append(httpx.get(url, headers={HEADER: cloud.cloud.internal_secret}, timeout=10).text)
            except httpx.TransportError:
                return False
        return len(texts) == 5

    wait_until("the five replicas' /metrics", replica_texts, timeout=60)
    for text in texts:
        names = {f.name for f in text_string_to_metric_families(text)}
        assert "nv_inference_request_success" in names
