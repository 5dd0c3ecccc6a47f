"""Admin API routes for tenants, keys, priority classes and usage (mounted by
:func:`octacloud.admin.api.build_admin_app`).

Admins manage every tenant, key and priority class and read everyone's usage; a tenant sees itself, manages its
own keys, sees the priority classes granted to it and reads its own usage. Something a caller may not see
answers 404 exactly as something that does not exist.

Handlers raise; one table of Starlette exception handlers (:data:`EXCEPTION_HANDLERS`) turns errors into
answers: no API key 401, not allowed 403, malformed 400, unknown 404, taken 409.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from octacloud.core import fields
from octacloud.core.errors import ConflictError, InvalidSpecError, NotFoundError, OctacloudError
from octacloud.core.fields import TENANT_NAME, TENANT_RULE
from octacloud.metering import GROUPS, Ledger, PriceSheet, report_totals
from octacloud.storage.store import StoreUnavailableError
from octacloud.tenancy.keys import (
    MAX_RATE,
    AuthError,
    KeyInfo,
    KeyStore,
    Principal,
    Quota,
    Role,
    Tenant,
    check_quota_fields,
    default_burst,
)
from octacloud.tenancy.limits import QuotaExceededError
from octacloud.tenancy.priority import PriorityClass, PriorityClasses, PriorityNotGrantedError


class ForbiddenError(OctacloudError):
    """The caller is known but may not do this (403)."""


ADMIN_ONLY = "this needs an admin key"
MISSING_KEY = "missing API key: send 'Authorization: Bearer <key>'"


def principal_of(request: Request) -> Principal | None:
    """The caller the gateway verified (None when the admin app is reached without the gateway's check)."""
    principal = request.scope.get("state", {}).get("principal")
    return principal if isinstance(principal, Principal) else None


def require_principal(request: Request) -> Principal:
    """The verified caller, or :class:`AuthError` (401)."""
    p = principal_of(request)
    if p is None:
        raise AuthError(MISSING_KEY)
    return p


def require_admin(request: Request) -> Principal:
    p = require_principal(request)
    if not p.is_admin:
        raise ForbiddenError(ADMIN_ONLY)
    return p


def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _answer(status: int) -> Any:
    async def handler(request: Request, exc: Exception) -> Response:
        return error(status, str(exc), {"www-authenticate": "Bearer"} if status == 401 else None)

    return handler


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error(exc.status_code, str(exc.detail))


EXCEPTION_HANDLERS: dict[Any, Any] = {
    AuthError: _answer(401),
    ForbiddenError: _answer(403),
    QuotaExceededError: _answer(403),
    PriorityNotGrantedError: _answer(403),
    InvalidSpecError: _answer(400),
    NotFoundError: _answer(404),
    ConflictError: _answer(409),
    StoreUnavailableError: _answer(503),
    HTTPException: _http_error,
}
"""Errors the admin and tenant APIs raise → their status (the body is always ``{"error": <message>}``)."""


def tenant_json(t: Tenant) -> dict[str, Any]:
    q = t.quota
    return {
        "name": t.name,
        "disabled": t.disabled,
        "created_at": t.created_at,
        "quota": {
            "octants": q.octants,
            "deployments": q.deployments,
            "requests_per_s": q.requests_per_s,
            "burst": q.burst,
            "tokens_per_minute": q.tokens_per_minute,
            "max_streams": q.max_streams,
        },
    }


def key_json(k: KeyInfo) -> dict[str, Any]:
    return {"id": k.id, "tenant": k.tenant, "role": k.role.value, "created_at": k.created_at,
            "revoked": k.revoked, "note": k.note}  # fmt: skip


_LAST_MS = 253_402_300_799_999
"""The end of the year 9999 in epoch milliseconds: the latest time a usage query may name."""


def parse_time(value: str | None, what: str) -> int | None:
    """Epoch seconds, or an ISO date/time (UTC unless it says otherwise) → epoch milliseconds."""
    if value is None or value == "":
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = None
    if seconds is not None:
        if not 0 <= seconds * 1000 <= _LAST_MS:  # NaN fails too
            raise InvalidSpecError(f"{what} must be epoch seconds from 0 to the year 9999, got {fields.shown(value)}")
        return int(seconds * 1000)
    try:
        when = dt.datetime.fromisoformat(value)
    except ValueError:
        raise InvalidSpecError(f"{what} must be epoch seconds or an ISO date/time, got {fields.shown(value)}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return int(when.timestamp() * 1000)


def query_whole(request: Request, name: str, default: int, low: int, high: int) -> int:
    """A whole-number query parameter in ``low..high`` (``default`` when absent)."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.isascii() or not raw.lstrip("-").isdigit() or len(raw) > 12:
        raise InvalidSpecError(f"{name} must be a whole number in {low}..{high}, got {fields.shown(raw)}")
    return fields.whole(int(raw), name, low, high)


async def json_object(request: Request) -> dict[str, Any]:
    """The body as a JSON object; 400 for anything else (malformed, nested deeper than Python's parser goes,
    integers of more digits than it converts, an array or a scalar)."""
    try:
        body = await request.json()
    except (ValueError, RecursionError):
        raise InvalidSpecError("request body must be a JSON object") from None
    if not isinstance(body, dict):
        raise InvalidSpecError("request body must be a JSON object")
    return body


QUOTA_FIELDS = ("octants", "deployments", "requests_per_s", "burst", "tokens_per_minute", "max_streams")


def _quota(body: dict[str, Any]) -> Quota:
    """A tenant's quota from a body (its name aside); a rate without a burst gets :func:`default_burst`."""
    unknown = sorted(set(body) - {"name", *QUOTA_FIELDS})
    if unknown:
        raise InvalidSpecError(f"unknown tenant field(s) {unknown}; allowed: {['name', *QUOTA_FIELDS]}")
    rate = body.get("requests_per_s")
    if rate is not None:
        rate = fields.number(rate, "quota requests_per_s", MAX_RATE)  # before a burst is derived from it
    burst = body.get("burst")
    quota = Quota(
        body.get("octants"),
        body.get("deployments"),
        rate,
        default_burst(rate) if burst is None else burst,
        body.get("tokens_per_minute"),
        body.get("max_streams"),
    )
    check_quota_fields(quota)
    return quota


def _flag(body: dict[str, Any], name: str) -> bool:
    return fields.flag(body.get(name, False), name)


def class_json(c: PriorityClass) -> dict[str, Any]:
    return {"name": c.name, "priority": c.priority, "description": c.description, "global_default": c.global_default}


def tenant_routes(
    keys: KeyStore, ledger: Ledger | None, prices: PriceSheet | None, priorities: PriorityClasses
) -> list[Route]:
    """The tenancy API under ``/admin``: tenants, their priority-class grants, keys, priority classes, usage. A
    tenant's ``priority-classes`` routes come before its ``{action}`` route, which would match them too."""
    tenants, switch = _tenant_routes(keys)
    grants = _grant_routes(keys, priorities)
    return [*tenants, *grants, switch, *_key_routes(keys), *_class_routes(priorities), *_usage_routes(ledger, prices)]


def _tenant_routes(keys: KeyStore) -> tuple[list[Route], Route]:
    """``/admin/tenants``: list, create, set a quota; and disable or enable (the route last of a tenant's)."""

    async def list_tenants(request: Request) -> JSONResponse:
        p = require_principal(request)
        tenants = keys.tenants() if p.is_admin else [keys.tenant(p.tenant)]
        return JSONResponse({"tenants": [tenant_json(t) for t in tenants]})

    async def create_tenant(request: Request) -> JSONResponse:
        require_admin(request)
        body = await json_object(request)
        name = body.get("name")
        if not isinstance(name, str):
            raise InvalidSpecError('body must be {"name": <tenant>, ...quota}')
        tenant = keys.create_tenant(name, _quota(body))
        return JSONResponse(tenant_json(tenant), status_code=201)

    async def set_disabled(request: Request) -> JSONResponse:
        require_admin(request)
        action = request.path_params["action"]
        if action not in ("disable", "enable"):
            raise NotFoundError(f"no route for POST /admin/tenants/<name>/{action} (use disable or enable)")
        return JSONResponse(tenant_json(keys.set_disabled(request.path_params["name"], action == "disable")))

    async def set_quota(request: Request) -> JSONResponse:
        require_admin(request)
        body = await json_object(request)
        if "name" in body:
            raise InvalidSpecError("unknown tenant field(s) ['name']")
        old = keys.tenant(request.path_params["name"]).quota
        merged = {"octants": old.octants, "deployments": old.deployments,
                  "requests_per_s": old.requests_per_s, "burst": old.burst,
                  "tokens_per_minute": old.tokens_per_minute, "max_streams": old.max_streams, **body}  # fmt: skip
        if "requests_per_s" in body and "burst" not in body:
            merged["burst"] = None  # a new rate without a burst: one second of it (default_burst), not the old one
        return JSONResponse(tenant_json(keys.set_quota(request.path_params["name"], _quota(merged))))

    routes = [
        Route("/admin/tenants", list_tenants, methods=["GET"]),
        Route("/admin/tenants", create_tenant, methods=["POST"]),
        Route("/admin/tenants/{name}/quota", set_quota, methods=["POST"]),
    ]
    return routes, Route("/admin/tenants/{name}/{action:str}", set_disabled, methods=["POST"])


def _grant_routes(keys: KeyStore, priorities: PriorityClasses) -> list[Route]:
    """``/admin/tenants/{name}/priority-classes``: grant a tenant a class, revoke it."""

    async def grant(request: Request) -> JSONResponse:
        require_admin(request)
        tenant = keys.tenant(request.path_params["name"]).name
        body = await json_object(request)
        unknown = sorted(set(body) - {"class", "default"})
        if unknown or not isinstance(body.get("class"), str):
            raise InvalidSpecError('body must be {"class": <priority class>, "default": <bool>}')
        g = priorities.grant(tenant, body["class"], _flag(body, "default"))
        return JSONResponse({"tenant": g.tenant, "class": g.priority_class, "default": g.default}, status_code=201)

    async def revoke_grant(request: Request) -> JSONResponse:
        require_admin(request)
        priorities.revoke(request.path_params["name"], request.path_params["cls"])
        return JSONResponse({"revoked": request.path_params["cls"], "tenant": request.path_params["name"]})

    return [
        Route("/admin/tenants/{name}/priority-classes", grant, methods=["POST"]),
        Route("/admin/tenants/{name}/priority-classes/{cls}", revoke_grant, methods=["DELETE"]),
    ]


def _key_routes(keys: KeyStore) -> list[Route]:
    """``/admin/keys``: list, create, revoke (a tenant key: its own tenant's only)."""

    async def list_keys(request: Request) -> JSONResponse:
        p = require_principal(request)
        wanted = request.query_params.get("tenant") or None
        tenant = wanted if p.is_admin else p.tenant
        return JSONResponse({"keys": [key_json(k) for k in keys.keys(tenant)]})

    async def create_key(request: Request) -> JSONResponse:
        p = require_principal(request)
        body = await json_object(request)
        unknown = sorted(set(body) - {"tenant", "role", "note"})
        if unknown:
            raise InvalidSpecError(f"unknown key field(s) {unknown}")
        tenant = fields.name(body.get("tenant", p.tenant), "tenant", TENANT_NAME, TENANT_RULE)
        role_name = body.get("role", Role.TENANT.value)
        if role_name not in (Role.ADMIN.value, Role.TENANT.value):
            raise InvalidSpecError(f"role must be admin or tenant, got {fields.shown(role_name)}")
        role = Role(role_name)
        if not p.is_admin and (tenant != p.tenant or role is not Role.TENANT):
            raise ForbiddenError("a tenant key may only create tenant keys for its own tenant")
        info, text = keys.create_key(tenant, role, fields.text(body.get("note", ""), "note", 200))
        return JSONResponse({**key_json(info), "key": text}, status_code=201)

    async def revoke_key(request: Request) -> JSONResponse:
        p = require_principal(request)
        key_id = request.path_params["id"]
        mine = {k.id for k in keys.keys(None if p.is_admin else p.tenant)}
        if key_id not in mine:
            raise NotFoundError(f"no key with id {key_id!r}")
        return JSONResponse(key_json(keys.revoke_key(key_id)))

    return [
        Route("/admin/keys", list_keys, methods=["GET"]),
        Route("/admin/keys", create_key, methods=["POST"]),
        Route("/admin/keys/{id}", revoke_key, methods=["DELETE"]),
    ]


def _class_routes(priorities: PriorityClasses) -> list[Route]:
    """``/admin/priority-classes``: list, define, remove."""

    async def list_classes(request: Request) -> JSONResponse:
        """Admins: every class and every grant; a tenant: the classes it may name, and its default."""
        p = require_principal(request)
        classes = priorities.classes()
        if p.is_admin:
            grants = priorities.grants()
        else:
            grants = priorities.grants(p.tenant)
            mine = {g.priority_class for g in grants}
            classes = [c for c in classes if c.name in mine or c.global_default]
        return JSONResponse(
            {
                "classes": [class_json(c) for c in classes],
                "grants": [{"tenant": g.tenant, "class": g.priority_class, "default": g.default} for g in grants],
            }
        )

    async def define_class(request: Request) -> JSONResponse:
        require_admin(request)
        body = await json_object(request)
        unknown = sorted(set(body) - {"name", "priority", "description", "global_default"})
        if unknown:
            raise InvalidSpecError(f"unknown priority class field(s) {unknown}")
        if "name" not in body or "priority" not in body:
            raise InvalidSpecError('body must be {"name": <class>, "priority": <integer>, ...}')
        description, default = body.get("description", ""), _flag(body, "global_default")
        c = priorities.define(body["name"], body["priority"], description, default)
        return JSONResponse(class_json(c), status_code=201)

    async def remove_class(request: Request) -> JSONResponse:
        require_admin(request)
        priorities.remove(request.path_params["name"])
        return JSONResponse({"deleted": request.path_params["name"]})

    return [
        Route("/admin/priority-classes", list_classes, methods=["GET"]),
        Route("/admin/priority-classes", define_class, methods=["POST"]),
        Route("/admin/priority-classes/{name}", remove_class, methods=["DELETE"]),
    ]


def _usage_routes(ledger: Ledger | None, prices: PriceSheet | None) -> list[Route]:
    """``/admin/usage``: the ledger's totals (a tenant: its own), priced by ``prices``."""

    async def usage(request: Request) -> JSONResponse:
        p = require_principal(request)
        if ledger is None:
            raise NotFoundError("usage metering is off in this cloud")
        q = request.query_params
        tenant = q.get("tenant") or None
        if not p.is_admin:
            if tenant not in (None, p.tenant):
                raise NotFoundError(f"no tenant named {tenant!r}")
            tenant = p.tenant
        by = q.get("by", "deployment")
        if by not in GROUPS:
            raise InvalidSpecError(f"by must be one of {', '.join(GROUPS)}, got {by!r}")
        since, until = parse_time(q.get("from"), "from"), parse_time(q.get("to"), "to")
        deployment = q.get("deployment") or None
        totals = ledger.totals(by, tenant, since, until, None if deployment is None else [deployment])
        body = report_totals(totals, by, prices)
        body.update({"tenant": tenant, "from_ms": since, "to_ms": until})
        return JSONResponse(body)

    return [Route("/admin/usage", usage, methods=["GET"])]
