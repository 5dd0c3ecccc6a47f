"""``octacloud usage``: what each tenant used (octant-seconds, execution time, requests, traffic, storage, a
generative deployment's prompt and completion tokens, and the energy of its share of its cards)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import typer
from rich.table import Table

from octacloud.cli.cloud import CACERT, KEY, URL, _call, _url, console, err

COLUMNS = ("tenant", "group", "octant_seconds", "exec_seconds", "inferences", "requests", "bytes_in", "bytes_out",
           "storage_gb_months", "prompt_tokens", "completion_tokens", "energy_wh", "cost")  # fmt: skip


def usage(
    tenant: str | None = typer.Option(None, "--tenant", help="One tenant (admin; a tenant key sees its own)."),
    since: str | None = typer.Option(None, "--from", help="Start: ISO date/time (UTC) or epoch seconds."),
    until: str | None = typer.Option(None, "--to", help="End (exclusive)."),
    by: str = typer.Option("deployment", "--by", help="Group by deployment, day, gpu-model or tenant."),
    deployment: str | None = typer.Option(None, "--deployment", help="One deployment only."),
    fmt: str = typer.Option("table", "--format", help="table, csv or json."),
    url: str | None = URL,
    key: str | None = KEY,
    cacert: Path | None = CACERT,
) -> None:
    """Usage report from the ledger (closed intervals only)."""
    if fmt not in ("table", "csv", "json"):
        err.print(f"[red]error:[/] --format must be table, csv or json, got {fmt!r}")
        raise typer.Exit(2)
    params = {k: v for k, v in (("tenant", tenant), ("from", since), ("to", until), ("by", by),
                                ("deployment", deployment)) if v}  # fmt: skip
    data = _call("GET", _url(url), f"/admin/usage?{urlencode(params)}", None, key, cacert)
    if fmt == "json":
        console.print_json(json.dumps(data))
        return
    rows: list[dict[str, Any]] = [*data["lines"], data["total"]]
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows({c: r.get(c, 0) for c in COLUMNS} for r in rows)
        typer.echo(buffer.getvalue(), nl=False)
        return
    priced = data.get("currency") is not None
    table = Table(title=f"usage by {data['by']}" + (f" ({data['currency']})" if priced else ""))
    by_tenant = data["by"] == "tenant"  # the group is the tenant: one column for both
    names = ["tenant"] if by_tenant else ["tenant", data["by"]]
    headers = [*names, "octant-s", "exec s", "inferences", "requests", "MB in", "MB out", "GB-months",
               "prompt tok", "completion tok", "Wh"]  # fmt: skip
    for col in [*headers, *(["cost"] if priced else [])]:
        table.add_column(col, justify="left" if col in names else "right")
    for r in rows:
        label = [r["tenant"] or r["group"]] if by_tenant else [r["tenant"], r["group"]]
        cells = [*label, f"{r['octant_seconds']:.1f}", f"{r['exec_seconds']:.3f}",
                 str(r["inferences"]), str(r["requests"]), f"{r['bytes_in'] / 1e6:.3f}",
                 f"{r['bytes_out'] / 1e6:.3f}", f"{r['storage_gb_months']:.3g}",
                 str(r.get("prompt_tokens", 0)), str(r.get("completion_tokens", 0)),
                 f"{r.get('energy_wh', 0):.3f}"]  # fmt: skip
        table.add_row(*cells, *([f"{r['cost']:.4f}"] if priced else []))
    console.print(table)


def register(app: typer.Typer) -> None:
    app.command()(usage)
