"""The dashboard at a thousand cards in a real browser (headless Debian Chromium, driven by Playwright).

The page and its data come from the dashboard's own app (``build_dashboard_app``, its key check included) over a
document of 125 nodes × 8 cards with 1,000 replicas of 40 deployments (``big_fleet``); the browser's requests are
answered by that app in process, so no port is opened. The fleet map must be one cell per node grouped by rack
with each node's octants counted right, zoom on a click to the node's cards and octants with every label inside
its replica's run and none overlapping, give every deployment its own colour, and keep the tables to a page of
rows. Screenshots go to the test's tmp dir (their paths are printed).

The second test draws a live cloud of the same fleet (125 emulated nodes × 8 cards, 1,000 replicas of 40
deployments placed by the real controller, read through the gateway) and checks the rack view and one node's
octants against the admin API.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from starlette.testclient import TestClient

from octacloud.admin.dashboard.app import build_dashboard_app
from octacloud.control.emulated import EmulatedLauncher
from octacloud.control.fleet_gen import FleetShape, generated_fleet

from ..scale.test_emulated_cloud import config_for, ready, write_model
from .big_fleet import DEPLOYMENTS, NODES, RACKS, REPLICAS_EACH, big_document
from .chromium import CHROMIUM, chromium_page
from .conftest import CloudThread, wait_until

pytestmark = pytest.mark.slow

KEY = "oc_0123456789ab_" + "k" * 43
ORIGIN = "http://127.0.0.1:9"  # never connected to: every request is answered by the app in process
ZOOM = "r00-n09"  # six deployments, runs of one to four octants

RACK_VIEW = """() => ({
  view: document.querySelector('#fleet').dataset.view,
  racks: [...document.querySelectorAll('.rack')].map(r => ({rack: r.dataset.rack,
    nodes: [...r.querySelectorAll('.node-cell')].map(c => c.dataset.zoom)})),
  cells: [...document.querySelectorAll('.node-cell')].map(c => {
    const b = c.getBoundingClientRect();
    const inner = [...c.children].map(e => e.getBoundingClientRect());
    return {node: c.dataset.zoom, held: +c.dataset.held, text: c.querySelector('.use').textContent,
      box: [b.left, b.top, b.right, b.bottom],
      fits: inner.every(i => i.left >= b.left - 0.5 && i.right <= b.right + 0.5 && i.bottom <= b.bottom + 0.5)};
  }),
  legend: [...document.querySelectorAll('#legend span[data-name]')].map(s =>
    [s.dataset.name, getComputedStyle(s.querySelector('i')).backgroundColor]),
  elements: document.querySelectorAll('*').length,
})"""
NODE_VIEW = """() => ({
  view: document.querySelector('#fleet').dataset.view,
  cards: document.querySelectorAll('#fleet .card').length,
  octants: [...document.querySelectorAll('#fleet .octant')].map(e => [+e.dataset.gpu, e.dataset.replica || null]),
  labels: [...document.querySelectorAll('#fleet .run .label')].map(l => {
    const b = l.getBoundingClientRect(), r = l.parentElement.getBoundingClientRect();
    return {text: l.textContent, box: [b.left, b.top, b.right, b.bottom], run: [r.left, r.top, r.right, r.bottom],
      clipped: l.scrollWidth > l.clientWidth};
  }),
})"""


def overlapping(boxes: list[list[float]]) -> list[tuple[int, int]]:
    """Pairs of boxes (left, top, right, bottom) whose insides intersect."""
    return [
        (i, j)
        for i, a in enumerate(boxes)
        for j, b in enumerate(boxes[i + 1 :], i + 1)
        if a[0] < b[2] - 0.5 and b[0] < a[2] - 0.5 and a[1] < b[3] - 0.5 and b[1] < a[3] - 0.5
    ]


def authorize(headers: Mapping[str, str]) -> bool:
    return headers.get("authorization") == f"Bearer {KEY}"


def test_a_thousand_cards_by_rack_and_node_then_one_node_card_by_card(tmp_path: Path) -> None:
    if not CHROMIUM.exists():
        pytest.fail("Debian's chromium is missing: run `make browser` (apt-get install chromium chromium-driver)")
    from playwright.sync_api import Route

    doc = big_document()
    client = TestClient(build_dashboard_app(lambda since: doc, authorize))
    answered: Counter[str] = Counter()

    def answer(route: Route) -> None:
        url = urlsplit(route.request.url)
        headers = {k: v for k, v in route.request.headers.items() if k == "authorization"}
        r = client.get(url.path + (f"?{url.query}" if url.query else ""), headers=headers, follow_redirects=False)
        answered[f"{url.path} {r.status_code}"] += 1
        route.fulfill(status=r.status_code, headers=dict(r.headers), body=r.content)

    with chromium_page() as page:
        page.route(f"{ORIGIN}/**", answer)
        page.goto(f"{ORIGIN}/dashboard/")
        page.fill("#login-key", KEY)
        page.click("#login-form button[type=submit]")
        page.wait_for_selector(".node-cell")
        check_racks(page.evaluate(RACK_VIEW), doc)
        check_tables(page)
        shot(page, tmp_path / "dashboard-1000-cards-racks.png", "#fleet-section")
        shot(page, tmp_path / "dashboard-1000-cards-page.png", None)

        page.click(f'.node-cell[data-zoom="{ZOOM}"]')
        page.wait_for_selector('#fleet[data-view="node"] .card')
        check_node(page.evaluate(NODE_VIEW), doc)
        shot(page, tmp_path / "dashboard-1000-cards-node.png", "#fleet-section")
        page.wait_for_timeout(1500)  # a poll later, still zoomed in
        assert page.evaluate(NODE_VIEW)["view"] == "node"
        page.select_option("#colour-by", "tenant")
        by_tenant = page.evaluate(NODE_VIEW)
        assert not overlapping([label["box"] for label in by_tenant["labels"]])
        assert not [label for label in by_tenant["labels"] if label["clipped"]]
        page.click('.crumbs [data-zoom=""]')
        page.wait_for_selector('#fleet[data-view="racks"]')
    assert answered["/dashboard/api/state 200"] >= 2 and answered["/dashboard/api/state 401"] >= 1


def check_racks(view: dict[str, Any], doc: dict[str, Any]) -> None:
    """One section per rack, one cell per node (none overlapping, its text inside it), its octants counted."""
    assert view["view"] == "racks"
    assert [r["rack"] for r in view["racks"]] == [f"r{k:02d}" for k in range(RACKS)]
    assert all(len(r["nodes"]) == NODES // RACKS for r in view["racks"])
    held = {n["name"]: sum(1 for c in n["cards"] for o in c["octants"] if o is not None) for n in doc["fleet"]["nodes"]}
    assert {c["node"]: c["held"] for c in view["cells"]} == held
    assert all(c["text"] == f"{held[c['node']]}/64" for c in view["cells"])
    assert not overlapping([c["box"] for c in view["cells"]])
    assert all(c["fits"] for c in view["cells"]), [c["node"] for c in view["cells"] if not c["fits"]]
    colours = dict(view["legend"])
    assert len(colours) == DEPLOYMENTS and len(set(colours.values())) == DEPLOYMENTS  # a colour each
    assert view["elements"] < 3000, view["elements"]  # no DOM node per octant or per replica


def check_tables(page: Any) -> None:
    """A page of rows, however many replicas; the pager moves through them and the filter narrows them."""
    assert page.locator("#replicas tbody tr").count() == 50
    assert page.locator('.pager[data-for="replicas"] .range').text_content() == "1–50 of 1000"
    page.click('.pager[data-for="replicas"] [data-step="1"]')
    assert page.locator('.pager[data-for="replicas"] .range').text_content() == "51–100 of 1000"
    assert page.locator("#replicas tbody tr").first.get_attribute("data-replica") == "model-10-001"
    page.fill('.pager[data-for="replicas"] input', "model-13-")
    page.wait_for_function("() => document.querySelector('.pager[data-for=\"replicas\"] .range').textContent"
                           " === '1–25 of 25 (of 1000)'")  # fmt: skip
    assert page.locator("#deployments tbody tr").count() == 25


def check_node(view: dict[str, Any], doc: dict[str, Any]) -> None:
    """The node's 8 cards × 8 octants as the document places them, a label per run inside it, none overlapping."""
    node = next(n for n in doc["fleet"]["nodes"] if n["name"] == ZOOM)
    assert view["view"] == "node" and view["cards"] == len(node["cards"])
    expected = Counter((c["index"], o["replica"] if o else None) for c in node["cards"] for o in c["octants"])
    assert Counter((g, r) for g, r in view["octants"]) == expected
    runs = {(c["index"], o["replica"]) for c in node["cards"] for o in c["octants"] if o}
    labels = view["labels"]
    assert len(labels) == len(runs) and labels
    for label in labels:
        box, run = label["box"], label["run"]
        assert run[0] - 0.5 <= box[0] and box[2] <= run[2] + 0.5, label
        assert not label["clipped"], label
    assert not overlapping([label["box"] for label in labels])


def shot(page: Any, path: Path, selector: str | None) -> None:
    if selector is None:
        page.screenshot(path=str(path), full_page=True)
    else:
        page.locator(selector).screenshot(path=str(path))
    print(f"screenshot: {path}")


# ---- the same views over a live cloud: 125 emulated nodes × 8 cards, replicas placed by the real controller ----

LIVE = [(f"model-{k:02d}", (1, 2, 4, 8)[k % 4]) for k in range(DEPLOYMENTS)]
"""Deployments of the live test, as (name, octants), :data:`REPLICAS_EACH` replicas each (1,000 replicas)."""


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CloudThread]:
    root = tmp_path_factory.mktemp("live")
    for name, _ in LIVE:
        write_model(root / "models", name)
    cloud = CloudThread(config_for(root), generated_fleet(FleetShape(nodes=NODES, cards=8, racks=RACKS)))
    try:
        for name, octants in LIVE:
            n = REPLICAS_EACH
            body = {"name": name, "model": name, "octants": octants, "min_replicas": n, "max_replicas": n}
            assert cloud.post("/admin/deployments", body).status_code == 201
        wait_until("1,000 ready replicas", lambda: len(ready(cloud)) == REPLICAS_EACH * len(LIVE), timeout=300)
        yield cloud
    finally:
        cloud.stop()
        EmulatedLauncher(root / "var" / "replicas").stop_hosts()


def test_a_live_thousand_card_cloud_by_rack_then_one_node(live: CloudThread, tmp_path: Path) -> None:
    if not CHROMIUM.exists():
        pytest.fail("Debian's chromium is missing: run `make browser` (apt-get install chromium chromium-driver)")
    rows = [r for d in live.get("/admin/deployments").json()["deployments"] for r in d["instances"]]
    held = Counter({n["name"]: 0 for n in live.get("/admin/fleet").json()["nodes"]})
    cells: Counter[tuple[str, int, str | None]] = Counter()
    for r in rows:
        for g in r["gpus"]:
            held[r["node"]] += r["milli_per_gpu"] // 125
            cells[(r["node"], g, str(r["id"]))] += r["milli_per_gpu"] // 125
    busiest = max(held, key=lambda n: (len({k[2] for k in cells if k[0] == n}), n))
    with chromium_page() as page:
        page.goto(f"{live.url}/dashboard/")
        page.fill("#login-key", live.key)
        page.click("#login-form button[type=submit]")
        page.wait_for_selector(".node-cell")
        view = page.evaluate(RACK_VIEW)
        assert [r["rack"] for r in view["racks"]] == [f"r{k:02d}" for k in range(RACKS)]
        assert {c["node"]: c["held"] for c in view["cells"]} == dict(held)
        assert not overlapping([c["box"] for c in view["cells"]])
        assert len(set(dict(view["legend"]).values())) == len(LIVE)
        shot(page, tmp_path / "live-1000-cards-racks.png", "#fleet-section")
        page.click(f'.node-cell[data-zoom="{busiest}"]')
        page.wait_for_selector('#fleet[data-view="node"] .card')
        node = page.evaluate(NODE_VIEW)
        shown = Counter((busiest, g, r) for g, r in node["octants"] if r)
        assert shown == +Counter({k: v for k, v in cells.items() if k[0] == busiest})
        assert node["labels"] and not overlapping([label["box"] for label in node["labels"]])
        assert not [label for label in node["labels"] if label["clipped"]]
        shot(page, tmp_path / "live-1000-cards-node.png", "#fleet-section")
