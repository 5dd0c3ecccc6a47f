"""The dashboard's render and update time in a real browser (headless Debian Chromium, driven by Playwright),
for fleets of 8, 1,000 and 4,000 cards.

Each size's dashboard document (``tests/dashboard/big_fleet.py``: racks of 25 nodes × 8 cards, 25 replicas per
deployment, 40 deployments per 1,000 cards) is served by the dashboard's own app in process (the browser's
requests are answered through Playwright's routing; no port is opened). The bench prints, per size: the
document's size, the time from opening the page to the first drawn map (fetch, parse and render), one redraw
of every part and one of a poll that changed nothing (medians of ``--repeats``, style and layout included),
``JSON.parse`` of the document, the zoom into one node, and the elements in the page. ``fleet_scale.py``
calls :func:`measure` on the live cloud's document.

Run: ``python bench/dashboard_render.py`` (``--sizes 8,1000,4000``; ``--repeats 10``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from starlette.testclient import TestClient
from tests.dashboard.big_fleet import big_document
from tests.dashboard.chromium import CHROMIUM, chromium_page

from octacloud.admin.dashboard.app import build_dashboard_app
from record import Recorder, add_flag

ORIGIN = "http://127.0.0.1:9"  # never connected to: the app answers every request in process
FLAGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
TIMED = """([repeats, text]) => {
  const settle = () => document.body.getBoundingClientRect().height;  // style and layout, as a paint needs
  const time = (fn) => { const t = performance.now(); fn(); settle(); return performance.now() - t; };
  const med = (xs) => xs.sort((a, b) => a - b)[Math.floor(xs.length / 2)];
  const redraw = [], same = [], parse = [], zoom = [];
  const node = last.fleet.nodes[Math.floor(last.fleet.nodes.length / 2)].name;
  for (let k = 0; k < repeats; k++) {
    redraw.push(time(() => { drawn = new WeakMap(); render(last); }));  // every part drawn anew
    same.push(time(() => render(last)));  // a poll that brings the same fleet: nothing changed, nothing redrawn
    parse.push(time(() => JSON.parse(text)));
    zoom.push(time(() => { fleetView.zoom = node; renderFleet(last.fleet, "deployment"); }));
    fleetView.zoom = "";
  }
  render(last);
  return {redraw_ms: med(redraw), same_ms: med(same), parse_ms: med(parse), zoom_ms: med(zoom),
          elements: document.querySelectorAll("*").length, view: document.querySelector("#fleet").dataset.view};
}"""


def measure(document: dict[str, Any], repeats: int = 10) -> dict[str, Any]:
    """Render figures for ``document`` (a dashboard document) in Chromium; ``{}`` where Chromium is missing."""
    if not CHROMIUM.exists():
        return {}
    from playwright.sync_api import Route

    text = json.dumps(document)
    client = TestClient(build_dashboard_app(lambda since: document))

    def answer(route: Route) -> None:
        url = urlsplit(route.request.url)
        r = client.get(url.path + (f"?{url.query}" if url.query else ""), follow_redirects=False)
        route.fulfill(status=r.status_code, headers=dict(r.headers), body=r.content)

    with chromium_page(FLAGS) as page:
        page.route(f"{ORIGIN}/**", answer)
        page.goto(f"{ORIGIN}/dashboard/", wait_until="commit")
        page.wait_for_selector("#fleet .node-cell, #fleet .octant", timeout=120_000)
        first = page.evaluate("() => performance.now()")  # since navigation: fetch, parse, first render
        out: dict[str, Any] = page.evaluate(TIMED, [repeats, text])
    return {"document_kib": len(text) / 1024, "first_map_ms": first, **out}


def documents(sizes: list[int]) -> list[tuple[int, dict[str, Any]]]:
    """Per card count: the document (8 cards: one node of 4 deployments × 2 replicas)."""
    out = []
    for cards in sizes:
        nodes = max(1, cards // 8)
        if nodes == 1:
            out.append((cards, big_document(nodes=1, racks=1, deployments=4, replicas_each=2)))
        else:
            out.append((cards, big_document(nodes=nodes, racks=max(1, nodes // 25), deployments=max(1, cards // 25))))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,1000,4000", help="Card counts.")
    parser.add_argument("--repeats", type=int, default=10, help="Redraws to time per size (the median is kept).")
    add_flag(parser)
    args = parser.parse_args()
    if not CHROMIUM.exists():
        sys.exit(f"{CHROMIUM} is missing: make browser (apt-get install chromium)")
    recorder = Recorder("dashboard_render")
    results = []
    for cards, document in documents([int(s) for s in args.sizes.split(",")]):
        figures = {"cards": cards, "replicas": len(document["replicas"]), **measure(document, args.repeats)}
        results.append(figures)
        print(
            f"{cards:>5} cards, {figures['replicas']:>4} replicas ({figures['view']} view): document "
            f"{figures['document_kib']:.0f} KiB, first map {figures['first_map_ms']:.0f} ms, redraw "
            f"{figures['redraw_ms']:.1f} ms (unchanged {figures['same_ms']:.1f} ms), "
            f"parse {figures['parse_ms']:.1f} ms, zoom {figures['zoom_ms']:.1f} ms, "
            f"{figures['elements']} elements",
            flush=True,
        )
    base = results[0]
    for r in results[1:]:
        print(f"{r['cards']} cards ÷ {base['cards']}: redraw ×{r['redraw_ms'] / max(1e-9, base['redraw_ms']):.1f}")
    recorder.save(results)


if __name__ == "__main__":
    main()
