"""Admin API routes for tenants, keys and usage (mounted by :func:`octacloud.cluster.admin.build_admin_app`).

Admins manage every tenant and key and read everyone's usage; a tenant sees itself, manages its own keys and
reads its own usage. Something a caller may not see answers 404 exactly as something that does not exist.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from octacloud.cluster.auth.keys import KeyInfo, KeyStore, Principal, Quota, Role, Tenant
from octacloud.core.errors import InvalidSpecError, NotFoundError
from octacloud.metering import GROUPS, Ledger, PriceSheet, report_totals


def principal_of(request: Request) -> Principal | None:
    """The caller the gateway verified (None when the admin app is reached without the gateway's check)."""
    principal = request.scope.get("state", {}).get("principal")
    return principal if isinstance(principal, Principal) else None


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def unauthenticated() -> JSONResponse:
    return error(401, "missing API key: send 'Authorization: Bearer <key>'")


ADMIN_ONLY = "this needs an admin key"


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
        },
    }


def key_json(k: KeyInfo) -> dict[str, Any]:
    return {"id": k.id, "tenant": k.tenant, "role": k.role.value, "created_at": k.created_at,
            "revoked": k.revoked, "note": k.note}  # fmt: skip


def parse_time(value: str | None, what: str) -> int | None:
    """Epoch seconds, or an ISO date/time (UTC unless it says otherwise) → epoch milliseconds."""
    if value is None or value == "":
        return None
    try:
        return int(float(value) * 1000)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(value)
    except ValueError:
        raise InvalidSpecError(f"{what} must be epoch seconds or an ISO date/time, got {value!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return int(when.timestamp() * 1000)


async def _json_object(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise InvalidSpecError("request body must be a JSON object") from None
    if not isinstance(body, dict):
        raise InvalidSpecError("request body must be a JSON object")
    return body


def _quota(body: dict[str, Any]) -> Quota:
    unknown = sorted(set(body) - {"name", "octants", "deployments", "requests_per_s", "burst"})
    if unknown:
        raise InvalidSpecError(f"unknown tenant field(s) {unknown}")
    for name in ("octants", "deployments", "burst"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise InvalidSpecError(f"{name} must be a whole number, got {value!r}")
    rate = body.get("requests_per_s")
    if rate is not None and (not isinstance(rate, int | float) or isinstance(rate, bool)):
        raise InvalidSpecError(f"requests_per_s must be a number, got {rate!r}")
    return Quota(body.get("octants"), body.get("deployments"), rate, body.get("burst") or 50)


def tenant_routes(keys: KeyStore, ledger: Ledger | None, prices: PriceSheet | None) -> list[Route]:
    async def list_tenants(request: Request) -> JSONResponse:
        p = principal_of(request)
        if p is None:
            return unauthenticated()
        tenants = keys.tenants() if p.is_admin else [keys.tenant(p.tenant)]
        return JSONResponse({"tenants": [tenant_json(t) for t in tenants]})

    async def create_tenant(request: Request) -> JSONResponse:
        p = principal_of(request)
        if p is None:
            return unauthenticated()
        if not p.is_admin:
            return error(403, ADMIN_ONLY)
        try:
            body = await _json_object(request)
            name = body.get("name")
            if not isinstance(name, str):
                raise InvalidSpecError('body must be {"name": <tenant>, ...quota}')
            tenant = keys.create_tenant(name, _quota(body))
        except InvalidSpecError as exc:
            return error(400, str(exc))
        return JSONResponse(tenant_json(tenant), status_code=201)

    async def set_disabled(request: Request) -> JSONResponse:
        p = principal_of(request)
        if p is None:
            return unauthenticated()
        if not p.is_admin:
            return error(403, ADMIN_ONLY)
        action = request.path_params["action"]
        if action not in ("disable", "enable"):
            return error(404, f"no route for POST /admin/tenants/<name>/{action} (use disable or enable)")
        disabled = action == "disable"
        try:
            tenant = keys.set_disabled(request.path_params["name"], disabled)
        except NotFoundError as exc:
            return error(404, str(exc))
        except InvalidSpecError as exc:
            return error(400, str(exc))
        return JSONResponse(tenant_json(tenant))

    async def set_quota(request: Request) -> JSONResponse:
        p = principal_of(request)
        if p is None:
            return unauthenticated()
        if not p.is_admin:
            return error(403, ADMIN_ONLY)
        try:
            body = await _json_object(request)
            if "name" in body:
                raise InvalidSpecError("unknown tenant field(s) ['name']")
            old = keys.tenant(request.path_params["name"]).quota
            merged = {"octants": old.octants, "deployments": old.deployments,
                      "requests_per_s": old.requests_per_s, "burst": old.burst, **body}  # fmt: skip
            tenant = keys.set_quota(request.path_params["name"], _quota(merged))
        except NotFoundError as exc:
            return error(404, str(exc))
        except InvalidSpecError as exc:
            return error(400, str(exc))
        return JSONResponse(tenant_json(tenant))

    async def list_keys(request: Request) -> JSONResponse:
        p = principal_of(request)
        if p is None:
            return unauthenticated()
        wanted = request.query_params.get("tenant") or None
        tenant = wanted if p.is_admin else p.tenant
        return JSONResponse({"keys": [key_json(k) for k in keys.keys(tenant)]})

    async def create_key(request: Request) -> JSONResponse:
        p = principal_of(request)
        if p is None:
            return unauthenticated()
        try:
            body = await _json_object(request)
            unknown = sorted(set(body) - {"tenant", "role", "note"})
            if unknown:
                raise InvalidSpecError(f"unknown key field(s) {unknown}")
            tenant = str(body.get("tenant") or p.tenant)
            role = Role(body.get("role", Role.TENANT.value))
            if not p.is_admin and (tenant != p.tenant or role is not Role.TENANT):
                return error(403, "a tenant key may only create tenant keys for its own tenant")
            info, text = keys.create_key(tenant, role, str(body.get("note", "")))
        except ValueError as exc:  # InvalidSpecError, or an unknown role
            return error(400, str(exc) if isinstance(exc, InvalidSpecError) else "role must be admin or tenant")
        except NotFoundError as exc:
            return error(404, str(exc))
        return JSONResponse({**key_json(info), "key": text}, status_code=201)

    async def revoke_key(request: Request) -> JSONResponse:
        p = principal_of(request)
        if p is None:
            return unauthenticated()
        key_id = request.path_params["id"]
        mine = {k.id for k in keys.keys(None if p.is_admin else p.tenant)}
        if key_id not in mine:
            return error(404, f"no key with id {key_id!r}")
        return JSONResponse(key_json(keys.revoke_key(key_id)))

    async def usage(request: Request) -> JSONResponse:
        p = principal_of(request)
        if p is None:
            return unauthenticated()
        if ledger is None:
            return error(404, "usage metering is off in this cloud")
        q = request.query_params
        tenant = q.get("tenant") or None
        if not p.is_admin:
            if tenant not in (None, p.tenant):
                return error(404, f"no tenant named {tenant!r}")
            tenant = p.tenant
        by = q.get("by", "deployment")
        if by not in GROUPS:
            return error(400, f"by must be one of {', '.join(GROUPS)}, got {by!r}")
        try:
            since, until = parse_time(q.get("from"), "from"), parse_time(q.get("to"), "to")
        except InvalidSpecError as exc:
            return error(400, str(exc))
        deployment = q.get("deployment") or None
        totals = ledger.totals(by, tenant, since, until, None if deployment is None else [deployment])
        body = report_totals(totals, by, prices)
        body.update({"tenant": tenant, "from_ms": since, "to_ms": until})
        return JSONResponse(body)

    return [
        Route("/admin/tenants", list_tenants, methods=["GET"]),
        Route("/admin/tenants", create_tenant, methods=["POST"]),
        Route("/admin/tenants/{name}/quota", set_quota, methods=["POST"]),
        Route("/admin/tenants/{name}/{action:str}", set_disabled, methods=["POST"]),
        Route("/admin/keys", list_keys, methods=["GET"]),
        Route("/admin/keys", create_key, methods=["POST"]),
        Route("/admin/keys/{id}", revoke_key, methods=["DELETE"]),
        Route("/admin/usage", usage, methods=["GET"]),
    ]
