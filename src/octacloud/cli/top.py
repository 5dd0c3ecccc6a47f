"""``octacloud top``: the dashboard in a terminal (rich), for a server without a browser.

It polls the same JSON as the web dashboard (``/dashboard/api/state``, admin key) and draws the card map (one
cell per octant, coloured by deployment; one row per rack for a big fleet), allocation and fragmentation,
per-deployment load and batch sizes, replicas (counted per deployment when many) and the last events;
``--node``, ``--deployment`` and ``--tenant`` narrow it (``top_fleet``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import httpx
import typer
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from octacloud.cli.status_view import Filters
from octacloud.cli.top_fleet import FREE, OCTANT, fleet_view, narrow, palette, replicas_view

SPARK = "▁▂▃▄▅▆▇█"
NO_FILTERS = Filters()
DEPLOYMENT_ROWS = 60
"""More deployments than this are cut, saying how many more (``--deployment`` narrows them)."""
DEFAULT_URL = "http://127.0.0.1:8000"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f} %"


def sparkline(points: list[list[float]], width: int = 20, full: float | None = None) -> str:
    """The last ``width`` values as bars: a full bar is ``full`` (a fraction's 1.0: 100 %), or the largest value
    shown when there is no such scale (requests per second)."""
    values = [p[1] for p in points[-width:]]
    if not values:
        return ""
    top = full or max(values) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1)))] for v in values)


class History:
    """Series the terminal keeps between polls (the API sends only points newer than ``since``)."""

    def __init__(self, keep: int = 900) -> None:
        self.keep = keep
        self.since = 0.0
        self.series: dict[str, list[list[float]]] = {}

    def add(self, state: dict[str, Any]) -> None:
        self._extend("allocation", state["allocation"])
        self._extend("fragmentation", state["fragmentation"])
        for d in state["deployments"]:
            self._extend(f"qps:{d['name']}", d["qps"])
            self._extend(f"latency:{d['name']}", d["latency_ms"])
        self.since = max([self.since, *(p[0] for p in state["allocation"])])

    def _extend(self, key: str, points: list[list[float]]) -> None:
        series = self.series.setdefault(key, [])
        series.extend(points)
        del series[: max(0, len(series) - self.keep)]

    def get(self, key: str) -> list[list[float]]:
        return self.series.get(key, [])


def render(state: dict[str, Any], history: History, filters: Filters = NO_FILTERS) -> RenderableType:
    """One frame: a pure function of the dashboard document, the history kept so far and the filters. The header
    is the whole fleet's; the map and the tables show what the filters match, in the whole fleet's colours."""
    held = (o["deployment"] for n in state["fleet"]["nodes"] for c in n["cards"] for o in c["octants"] if o)
    colours = palette([*(d["name"] for d in state["deployments"]), *held])
    shown = narrow(state, filters)
    names = {r["deployment"] for r in shown["replicas"]} if filters.deployment or filters.tenant else None
    return Group(
        _header(state, history),
        *fleet_view(shown["fleet"]["nodes"], colours, names, filters),
        _deployments(shown, history, colours),
        replicas_view(shown["replicas"], filters),
        _tenants(shown["tenants"]),
        Panel(_events(shown["events"]), title="events", expand=True),
    )


def _header(state: dict[str, Any], history: History) -> Text:
    """The fleet's allocation and fragmentation with their history, the replicas, the scheduler's figures."""
    fleet = state["fleet"]
    replicas = state["replicas"]
    ready = sum(1 for r in replicas if r["state"] == "ready")
    sched = state["scheduler"]
    ms = sched["mean_decision_ms"]
    header = Text.assemble(
        ("octacloud  ", "bold"),
        (f"allocated {_pct(fleet['allocation'])}", "bold cyan"),
        f" {sparkline(history.get('allocation'), 30, full=1.0)}   ",  # fractions of the fleet: full is 100 %
        (f"fragmented {_pct(fleet['fragmentation'])}", "bold yellow"),
        f" {sparkline(history.get('fragmentation'), 30, full=1.0)}   ",
        f"replicas {ready}/{len(replicas)} ready, {sched['pending']} pending   ",
        f"decision {'–' if ms is None else f'{ms:.2f} ms'}   preemptions {sched['preemptions']}",
    )
    return header


def _deployments(state: dict[str, Any], history: History, colours: dict[str, str]) -> Table:
    """Each deployment: its tenant, size, readiness, request rate and latency with their history, batch sizes."""
    deployments = Table(title="deployments", expand=True, title_justify="left")
    for column in ("deployment", "tenant", "oct", "ready", "req/s", "", "latency", "batch sizes"):
        deployments.add_column(column, justify="right" if column in ("oct", "ready", "req/s", "latency") else "left")
    for d in state["deployments"][:DEPLOYMENT_ROWS]:
        qps, latency = history.get(f"qps:{d['name']}"), history.get(f"latency:{d['name']}")
        deployments.add_row(
            Text(d["name"], style=colours[d["name"]]),
            d["tenant"],
            str(d["octants"]),
            f"{d['ready']}/{d['desired']}",
            f"{qps[-1][1]:.1f}" if qps else "–",
            sparkline(qps),
            f"{latency[-1][1]:.1f} ms" if latency else "–",
            " ".join(f"{size}:{n}" for size, n in d["batch_sizes"].items()) or "–",
        )
    if len(state["deployments"]) > DEPLOYMENT_ROWS:
        deployments.caption = f"… {len(state['deployments']) - DEPLOYMENT_ROWS} more (--deployment PATTERN)"
    return deployments


def _tenants(tenants: list[dict[str, Any]]) -> Table:
    """Each tenant: its deployments, replicas, octants and usage."""
    table = Table(title="tenants", expand=True, title_justify="left")
    for column in ("tenant", "deployments", "replicas", "octants", "octant-seconds", "requests", "inferences"):
        table.add_column(column, justify="left" if column == "tenant" else "right")
    colours = palette(str(t["tenant"]) for t in tenants)
    for t in tenants:
        u = t.get("usage") or {}
        table.add_row(
            Text(str(t["tenant"]), style=colours[str(t["tenant"])]),
            str(t["deployments"]), str(t["replicas"]), str(t["octants"]),
            f"{u['octant_seconds']:,}" if u else "–", f"{u['requests']:,}" if u else "–",
            f"{u['inferences']:,}" if u else "–",
        )  # fmt: skip
    return table


def _events(events: list[dict[str, Any]]) -> Text:
    """The last eight events, newest first."""
    text = Text()
    for e in events[:8]:
        text.append(time.strftime("%H:%M:%S ", time.localtime(e["at"])), style="grey50")
        text.append(f"{e['kind']:<14}", style="bold")
        text.append(f"{e['subject']} — {e['message']}\n")
    text.rstrip()
    return text


def _key(key: str | None, state_dir: Path) -> str | None:
    if key:
        return key
    path = state_dir / "admin.key"
    return path.read_text().strip() if path.is_file() else None


def top(
    url: str | None = typer.Option(None, "--url", envvar="OCTACLOUD_URL", help=f"The gateway (default {DEFAULT_URL})."),
    key: str | None = typer.Option(None, "--key", envvar="OCTACLOUD_KEY", help="Admin API key."),
    state_dir: Path = typer.Option(Path("var"), "--state-dir", help="Where admin.key is (without --key)."),
    cacert: str | None = typer.Option(None, "--cacert", envvar="OCTACLOUD_CACERT", help="CA certificate (https)."),
    interval: float = typer.Option(1.0, "--interval", min=0.2, help="Seconds between redraws."),
    once: bool = typer.Option(False, "--once", help="Print one frame and exit (so does a top whose output is piped)."),
    node: str = typer.Option("", "--node", help="Only nodes (and replicas on nodes) matching this glob."),
    deployment: str = typer.Option("", "--deployment", help="Only deployments matching this glob (and their nodes)."),
    tenant: str = typer.Option("", "--tenant", help="Only deployments of tenants matching this glob."),
) -> None:
    """The fleet, the slices and the load, live in the terminal (needs an admin key). Past 24 nodes the fleet is
    drawn one row per rack and past 60 replicas they are counted per deployment, until a filter narrows them."""
    filters = Filters(node=node, deployment=deployment, tenant=tenant)
    once = once or not sys.stdout.isatty()
    base = (url or DEFAULT_URL).rstrip("/")
    admin_key = _key(key, state_dir)
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    client = httpx.Client(timeout=10.0, headers=headers, verify=cacert or True)
    history = History()
    err = Console(stderr=True)

    def fetch() -> dict[str, Any]:
        try:
            response = client.get(f"{base}/dashboard/api/state", params={"since": history.since})
        except httpx.HTTPError as exc:
            err.print(f"[red]error:[/] cannot reach octacloud at {base}: {exc} (is `octacloud up` running?)")
            raise typer.Exit(2) from None
        if response.status_code == 401:
            err.print("[red]error:[/] needs an admin key: --key, $OCTACLOUD_KEY or <state-dir>/admin.key")
            raise typer.Exit(1)
        if response.status_code != 200:
            err.print(f"[red]error:[/] {base}/dashboard/api/state answered {response.status_code}: {response.text}")
            raise typer.Exit(1)
        state: dict[str, Any] = response.json()
        history.add(state)
        return state

    with client:
        if once:
            Console(width=max(120, Console().width)).print(render(fetch(), history, filters))
            return
        with Live(render(fetch(), history, filters), auto_refresh=False, screen=True) as live:
            try:
                while True:
                    time.sleep(interval)
                    live.update(render(fetch(), history, filters), refresh=True)
            except KeyboardInterrupt:
                pass


def register(app: typer.Typer) -> None:
    app.command("top")(top)


__all__ = ["FREE", "OCTANT", "History", "register", "render", "sparkline"]
