"""``octacloud tenant create|list|set|disable|enable|grant|revoke``, ``octacloud key create|list|revoke`` and
``octacloud priority-class define|list|delete`` (admin API)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from octacloud.cli.cloud import CACERT, KEY, URL, _call, _url, console, err

tenant_app = typer.Typer(help="Tenants: who uses the cloud, with which quotas.", no_args_is_help=True)
key_app = typer.Typer(help="API keys: shown once when created, stored hashed.", no_args_is_help=True)
class_app = typer.Typer(
    help="Priority classes: the scheduling priorities an admin defines and grants to tenants.", no_args_is_help=True
)


def _quota(q: dict[str, Any]) -> str:
    parts = [
        f"{q['octants']} octants" if q["octants"] is not None else "",
        f"{q['deployments']} deployments" if q["deployments"] is not None else "",
        f"{q['requests_per_s']:g} req/s (burst {q['burst']})" if q["requests_per_s"] is not None else "",
        f"{q['tokens_per_minute']:,} tokens/min" if q.get("tokens_per_minute") is not None else "",
        f"{q['max_streams']} streams" if q.get("max_streams") is not None else "",
    ]
    return ", ".join(p for p in parts if p) or "unlimited"


@tenant_app.command("create")
def tenant_create(
    name: str = typer.Argument(..., help="Tenant name (lowercase letters, digits, '-', '_')."),
    octants: int | None = typer.Option(None, "--octants", help="Quota: octants its deployments may hold."),
    deployments: int | None = typer.Option(None, "--deployments", help="Quota: number of deployments."),
    rate: float | None = typer.Option(None, "--rate", help="Requests per second (token bucket)."),
    burst: int | None = typer.Option(
        None, "--burst", help="Requests admitted at once above the rate (default: one second of --rate, at least 1)."
    ),
    tokens: int | None = typer.Option(
        None, "--tokens-per-minute", help="Generation: prompt + completion tokens per minute."
    ),
    streams: int | None = typer.Option(None, "--max-streams", help="Generation: requests in flight at once."),
    with_key: bool = typer.Option(
        True, "--with-key/--no-key", help="Also create a tenant key and show it once (--no-key: the tenant only)."
    ),
    url: str | None = URL,
    key: str | None = KEY,
    cacert: Path | None = CACERT,
) -> None:
    """Create a tenant (admin)."""
    body = {"name": name, "octants": octants, "deployments": deployments, "requests_per_s": rate,
            "tokens_per_minute": tokens, "max_streams": streams}  # fmt: skip
    if burst is not None:
        body["burst"] = burst
    data = _call("POST", _url(url), "/admin/tenants", body, key, cacert)
    console.print(f"tenant [bold]{data['name']}[/]: {_quota(data['quota'])}")
    if with_key:
        created = _call("POST", _url(url), "/admin/keys", {"tenant": name}, key, cacert)
        console.print(f"key {created['id']} (shown once, keep it safe):\n  {created['key']}", soft_wrap=True)


@tenant_app.command("list")
def tenant_list(url: str | None = URL, key: str | None = KEY, cacert: Path | None = CACERT) -> None:
    """Tenants and their quotas (a tenant key sees its own)."""
    data = _call("GET", _url(url), "/admin/tenants", None, key, cacert)
    table = Table(title="tenants")
    for col in ("tenant", "state", "quota"):
        table.add_column(col)
    for t in data["tenants"]:
        table.add_row(t["name"], "disabled" if t["disabled"] else "active", _quota(t["quota"]))
    console.print(table)


@tenant_app.command("set")
def tenant_set(
    name: str = typer.Argument(..., help="The tenant."),
    octants: int | None = typer.Option(None, "--octants", help="Quota: octants its deployments may hold."),
    deployments: int | None = typer.Option(None, "--deployments", help="Quota: number of deployments."),
    rate: float | None = typer.Option(None, "--rate", help="Requests per second (token bucket)."),
    burst: int | None = typer.Option(
        None, "--burst", help="Requests admitted at once above the rate (default with a new --rate: one second of it)."
    ),
    tokens: int | None = typer.Option(
        None, "--tokens-per-minute", help="Generation: prompt + completion tokens per minute."
    ),
    streams: int | None = typer.Option(None, "--max-streams", help="Generation: requests in flight at once."),
    unlimited: list[str] = typer.Option(
        [], "--unlimited", help="Remove a limit: octants, deployments, rate, tokens or streams (repeatable)."
    ),
    url: str | None = URL,
    key: str | None = KEY,
    cacert: Path | None = CACERT,
) -> None:
    """Change a tenant's quota (admin); limits not named stay as they are."""
    fields = {"octants": "octants", "deployments": "deployments", "rate": "requests_per_s",
              "tokens": "tokens_per_minute", "streams": "max_streams"}  # fmt: skip
    body: dict[str, Any] = {}
    for what in unlimited:
        if what not in fields:
            err.print(f"[red]error:[/] --unlimited takes {', '.join(fields)}, not {what!r}")
            raise typer.Exit(2)
        body[fields[what]] = None
    given = {"octants": octants, "deployments": deployments, "requests_per_s": rate, "burst": burst,
             "tokens_per_minute": tokens, "max_streams": streams}  # fmt: skip
    body.update({k: v for k, v in given.items() if v is not None})
    data = _call("POST", _url(url), f"/admin/tenants/{name}/quota", body, key, cacert)
    console.print(f"tenant [bold]{data['name']}[/]: {_quota(data['quota'])}")


def _set(name: str, action: str, url: str | None, key: str | None, cacert: Path | None) -> None:
    data = _call("POST", _url(url), f"/admin/tenants/{name}/{action}", {}, key, cacert)
    console.print(f"tenant {data['name']}: {'disabled' if data['disabled'] else 'active'}")


@tenant_app.command("disable")
def tenant_disable(
    name: str = typer.Argument(..., help="The tenant."),
    url: str | None = URL,
    key: str | None = KEY,
    cacert: Path | None = CACERT,
) -> None:
    """Disable a tenant: its keys stop working at once (its deployments keep running)."""
    _set(name, "disable", url, key, cacert)


@tenant_app.command("enable")
def tenant_enable(
    name: str = typer.Argument(..., help="The tenant."),
    url: str | None = URL,
    key: str | None = KEY,
    cacert: Path | None = CACERT,
) -> None:
    """Enable a disabled tenant again."""
    _set(name, "enable", url, key, cacert)


@key_app.command("create")
def key_create(
    tenant: str | None = typer.Option(None, "--tenant", help="Whose key (default: the caller's tenant)."),
    admin: bool = typer.Option(False, "--admin", help="An admin key (tenant 'admin')."),
    note: str = typer.Option("", "--note", help="What the key is for."),
    url: str | None = URL,
    key: str | None = KEY,
    cacert: Path | None = CACERT,
) -> None:
    """Create an API key; it is shown once."""
    body: dict[str, Any] = {"role": "admin" if admin else "tenant", "note": note}
    if tenant is not None or admin:
        body["tenant"] = "admin" if admin else tenant
    data = _call("POST", _url(url), "/admin/keys", body, key, cacert)
    console.print(
        f"key {data['id']} for {data['tenant']} ({data['role']}), shown once:\n  {data['key']}", soft_wrap=True
    )


@key_app.command("list")
def key_list(
    tenant: str | None = typer.Option(None, "--tenant", help="Only this tenant's keys (admin; default: all)."),
    url: str | None = URL,
    key: str | None = KEY,
    cacert: Path | None = CACERT,
) -> None:
    """Key ids (never the keys themselves)."""
    data = _call("GET", _url(url), "/admin/keys" + (f"?tenant={tenant}" if tenant else ""), None, key, cacert)
    table = Table(title="keys")
    for col in ("id", "tenant", "role", "state", "note"):
        table.add_column(col)
    for k in data["keys"]:
        table.add_row(k["id"], k["tenant"], k["role"], "revoked" if k["revoked"] else "active", k["note"])
    console.print(table)


@key_app.command("revoke")
def key_revoke(
    key_id: str = typer.Argument(..., help="The key's id (the part after 'oc_')."),
    url: str | None = URL,
    key: str | None = KEY,
    cacert: Path | None = CACERT,
) -> None:
    """Revoke a key: it stops working at once."""
    data = _call("DELETE", _url(url), f"/admin/keys/{key_id}", None, key, cacert)
    console.print(f"revoked key {data['id']} of {data['tenant']}")


@tenant_app.command("grant")
def tenant_grant(
    name: str = typer.Argument(..., help="The tenant."),
    priority_class: str = typer.Argument(..., help="The priority class it may deploy with."),
    default: bool = typer.Option(False, "--default", help="Make it the class of its deploys that name none."),
    url: str | None = URL,
    key: str | None = KEY,
    cacert: Path | None = CACERT,
) -> None:
    """Let a tenant deploy with a priority class (admin)."""
    body = {"class": priority_class, "default": default}
    data = _call("POST", _url(url), f"/admin/tenants/{name}/priority-classes", body, key, cacert)
    console.print(f"tenant {data['tenant']} may use {data['class']}" + (" (its default)" if data["default"] else ""))


@tenant_app.command("revoke")
def tenant_revoke(
    name: str = typer.Argument(..., help="The tenant."),
    priority_class: str = typer.Argument(..., help="The priority class to take back."),
    url: str | None = URL,
    key: str | None = KEY,
    cacert: Path | None = CACERT,
) -> None:
    """Take a priority class back from a tenant (its running deployments keep their priority)."""
    _call("DELETE", _url(url), f"/admin/tenants/{name}/priority-classes/{priority_class}", None, key, cacert)
    console.print(f"tenant {name} may no longer use {priority_class}")


@class_app.command("define")
def class_define(
    name: str = typer.Argument(..., help="Class name (lowercase letters, digits, '-', '_')."),
    priority: int = typer.Option(..., "--priority", help="Its scheduling priority: higher preempts lower."),
    description: str = typer.Option("", "--description", help="What the class is for (shown by list)."),
    global_default: bool = typer.Option(
        False, "--global-default", help="The class of deploys whose tenant has no default class."
    ),
    url: str | None = URL,
    key: str | None = KEY,
    cacert: Path | None = CACERT,
) -> None:
    """Create or change a priority class (admin)."""
    body = {"name": name, "priority": priority, "description": description, "global_default": global_default}
    data = _call("POST", _url(url), "/admin/priority-classes", body, key, cacert)
    console.print(f"priority class [bold]{data['name']}[/]: {data['priority']}")


@class_app.command("list")
def class_list(url: str | None = URL, key: str | None = KEY, cacert: Path | None = CACERT) -> None:
    """Priority classes and grants (a tenant key sees those granted to it)."""
    data = _call("GET", _url(url), "/admin/priority-classes", None, key, cacert)
    table = Table(title="priority classes")
    for col in ("class", "priority", "granted to", "description"):
        table.add_column(col)
    for c in data["classes"]:
        granted = [
            g["tenant"] + (" (default)" if g["default"] else "") for g in data["grants"] if g["class"] == c["name"]
        ]
        if c["global_default"]:
            granted.insert(0, "every tenant (cloud default)")
        table.add_row(c["name"], str(c["priority"]), ", ".join(granted), c["description"])
    console.print(table)


@class_app.command("delete")
def class_delete(
    name: str = typer.Argument(..., help="The priority class to delete."),
    url: str | None = URL,
    key: str | None = KEY,
    cacert: Path | None = CACERT,
) -> None:
    """Delete a priority class and its grants (deployments that have its priority keep it)."""
    _call("DELETE", _url(url), f"/admin/priority-classes/{name}", None, key, cacert)
    console.print(f"deleted priority class {name}")


def register(app: typer.Typer) -> None:
    app.add_typer(tenant_app, name="tenant")
    app.add_typer(key_app, name="key")
    app.add_typer(class_app, name="priority-class")
