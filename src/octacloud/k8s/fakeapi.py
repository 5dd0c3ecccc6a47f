"""An in-memory Kubernetes API server for tests: an httpx transport that keeps objects and records requests.

It answers the REST paths the API server does (core ``/api/v1/...`` and ``/apis/<group>/<version>/...``,
namespaced or cluster-wide, lists with ``labelSelector`` and ``fieldSelector=spec.nodeName=...``), creates
(409 when the name is taken), replaces, JSON merge patches (the ``status`` subresource changes only status),
deletes, and the pods' ``binding`` subresource. Errors are ``Status`` objects, as the real server sends them.
Each request is recorded (:attr:`FakeApiServer.requests`) so that a test can check what a client sent.
"""

from __future__ import annotations

import copy
import itertools
import json
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from octacloud.k8s.resources import Obj


@dataclass(frozen=True, slots=True)
class Recorded:
    method: str
    path: str
    params: dict[str, str]
    body: Any
    content_type: str


@dataclass(frozen=True, slots=True)
class _Path:
    prefix: str
    """``/api/v1`` or ``/apis/<group>/<version>``."""
    namespace: str | None
    plural: str
    name: str | None
    sub: str | None


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


class FakeApiServer:
    """Objects by (API prefix, plural, namespace, name); every request is appended to :attr:`requests`."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str | None, str], Obj] = {}
        self.requests: list[Recorded] = []
        self.fail: dict[tuple[str, str], int] = {}
        """(method, path) → HTTP status to answer instead (to test error handling)."""
        self._version = itertools.count(1)
        self.transport = httpx.MockTransport(self._handle)

    # ---- test helpers ------------------------------------------------------------------------------------

    def put(self, prefix: str, plural: str, obj: Obj) -> Obj:
        """Store ``obj`` directly (a fixture), filling uid and resourceVersion."""
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta["resourceVersion"] = str(next(self._version))
        self.objects[(prefix, plural, meta.get("namespace"), meta["name"])] = obj
        return obj

    def get(self, prefix: str, plural: str, namespace: str | None, name: str) -> Obj:
        return self.objects[(prefix, plural, namespace, name)]

    def of(self, prefix: str, plural: str) -> list[Obj]:
        return [
            o
            for (p, pl, _, _), o in sorted(self.objects.items(), key=lambda kv: str(kv[0]))
            if (p, pl)
            == (
                prefix,
                plural,
            )
        ]

    def sent(self, method: str, path_part: str = "") -> list[Recorded]:
        return [r for r in self.requests if r.method == method and path_part in r.path]

    # ---- the server ----------------------------------------------------------------------------------------

    def _handle(self, request: httpx.Request) -> httpx.Response:
        body: Any = None
        if request.content:
            try:
                body = json.loads(request.content)
            except ValueError:
                return _status(400, "BadRequest", "the body is not JSON")
        params = dict(request.url.params)
        path = request.url.path
        self.requests.append(Recorded(request.method, path, params, body, request.headers.get("content-type", "")))
        if (request.method, path) in self.fail:
            return _status(self.fail[(request.method, path)], "InternalError", "injected failure")
        parsed = _parse(path)
        if parsed is None:
            return _status(404, "NotFound", f"the server could not find the requested resource {path}")
        method = request.method
        if parsed.name is None:
            if method == "GET":
                return self._list(parsed, params)
            if method == "POST":
                return self._create(parsed, body)
            return _status(405, "MethodNotAllowed", f"{method} on a collection")
        key = (parsed.prefix, parsed.plural, parsed.namespace, parsed.name)
        if parsed.sub == "binding" and method == "POST":
            return self._bind(key, body)
        current = self.objects.get(key)
        if current is None:
            return _status(404, "NotFound", f'{parsed.plural} "{parsed.name}" not found')
        if method == "GET":
            return _json(200, current)
        if method == "DELETE":
            del self.objects[key]
            return _json(200, {"kind": "Status", "status": "Success"})
        if method == "PATCH":
            if "merge-patch" not in request.headers.get("content-type", ""):
                return _status(415, "UnsupportedMediaType", "only merge patches are supported")
            if not isinstance(body, dict):
                return _status(400, "BadRequest", "a merge patch must be an object")
            if parsed.sub == "status":
                body = {"status": body.get("status")}
            elif parsed.sub is None and parsed.plural != "pods" and "status" in body and _has_status_sub(parsed):
                body = {k: v for k, v in body.items() if k != "status"}
            updated = merge_patch(current, body)
            updated["metadata"]["resourceVersion"] = str(next(self._version))
            self.objects[key] = updated
            return _json(200, updated)
        if method == "PUT":
            if not isinstance(body, dict):
                return _status(400, "BadRequest", "the body must be an object")
            sent_version = (body.get("metadata") or {}).get("resourceVersion")
            if sent_version and sent_version != current["metadata"]["resourceVersion"]:
                return _status(409, "Conflict", "the object has been modified; apply your changes to the latest")
            body = copy.deepcopy(body)
            body["metadata"] = {**current["metadata"], **body.get("metadata", {})}
            body["metadata"]["resourceVersion"] = str(next(self._version))
            self.objects[key] = body
            return _json(200, body)
        return _status(405, "MethodNotAllowed", method)

    def _list(self, parsed: _Path, params: dict[str, str]) -> httpx.Response:
        items = [
            o
            for (prefix, plural, ns, _), o in sorted(self.objects.items(), key=lambda kv: str(kv[0]))
            if prefix == parsed.prefix and plural == parsed.plural and (parsed.namespace in (None, ns))
        ]
        for selector in filter(None, params.get("labelSelector", "").split(",")):
            k, eq, v = selector.partition("=")
            labels_of = [(o, o["metadata"].get("labels") or {}) for o in items]
            items = [o for o, labels in labels_of if (labels.get(k) == v if eq else k in labels)]
        for selector in filter(None, params.get("fieldSelector", "").split(",")):
            k, _, v = selector.partition("=")
            if k != "spec.nodeName":
                return _status(400, "BadRequest", f"field selector {k!r} is not supported")
            items = [o for o in items if (o.get("spec") or {}).get("nodeName", "") == v]
        return _json(200, {"kind": "List", "apiVersion": "v1", "metadata": {}, "items": items})

    def _create(self, parsed: _Path, body: Any) -> httpx.Response:
        if not isinstance(body, dict) or not isinstance(body.get("metadata"), dict):
            return _status(400, "BadRequest", "an object with metadata is required")
        meta = body["metadata"]
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:5]}"
        if not meta.get("name"):
            return _status(422, "Invalid", "metadata.name: Required value")
        if parsed.namespace is not None:
            if meta.get("namespace", parsed.namespace) != parsed.namespace:
                return _status(400, "BadRequest", "the namespace of the object does not match the path")
            meta["namespace"] = parsed.namespace
        key = (parsed.prefix, parsed.plural, parsed.namespace, meta["name"])
        if key in self.objects:
            return _status(409, "AlreadyExists", f'{parsed.plural} "{meta["name"]}" already exists')
        obj = copy.deepcopy(body)
        obj["metadata"]["uid"] = str(uuid.uuid4())
        obj["metadata"]["resourceVersion"] = str(next(self._version))
        obj["metadata"].setdefault("generation", 1)
        self.objects[key] = obj
        return _json(201, obj)

    def _bind(self, key: tuple[str, str, str | None, str], body: Any) -> httpx.Response:
        pod = self.objects.get(key)
        if pod is None:
            return _status(404, "NotFound", f'pods "{key[3]}" not found')
        if not isinstance(body, dict) or body.get("kind") != "Binding":
            return _status(400, "BadRequest", "a Binding object is required")
        target = body.get("target") or {}
        if target.get("kind") != "Node" or not target.get("name"):
            return _status(422, "Invalid", "target: a Node with a name is required")
        uid = (body.get("metadata") or {}).get("uid")
        if uid and uid != pod["metadata"]["uid"]:
            return _status(409, "Conflict", "the pod's UID does not match the binding's")
        if (pod.get("spec") or {}).get("nodeName"):
            return _status(409, "Conflict", f"pod {key[3]} is already assigned to node {pod['spec']['nodeName']}")
        pod.setdefault("spec", {})["nodeName"] = target["name"]
        pod["metadata"]["resourceVersion"] = str(next(self._version))
        return _json(201, {"kind": "Status", "status": "Success"})


def _has_status_sub(parsed: _Path) -> bool:
    return parsed.prefix.startswith("/apis/")


def _parse(path: str) -> _Path | None:
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        prefix, rest = "/api/v1", parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        prefix, rest = f"/apis/{parts[1]}/{parts[2]}", parts[3:]
    else:
        return None
    namespace = None
    if len(rest) >= 3 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    if not rest or len(rest) > 3:
        return None
    return _Path(prefix, namespace, rest[0], rest[1] if len(rest) > 1 else None, rest[2] if len(rest) > 2 else None)


def _json(code: int, obj: Any) -> httpx.Response:
    return httpx.Response(code, json=obj)


def _status(code: int, reason: str, message: str) -> httpx.Response:
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "message": message}
    return httpx.Response(code, json={**body, "code": code})
