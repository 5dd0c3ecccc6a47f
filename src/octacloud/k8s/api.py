"""The Kubernetes API as octacloud's parts use it: a few REST calls over httpx.

:class:`KubeClient` speaks the API server's REST paths and JSON (merge patches, the ``binding`` and ``status``
subresources, ``Status`` error objects). It finds the API server as a pod does (the in-cluster service account:
``KUBERNETES_SERVICE_HOST``, the mounted token and CA), or at an explicit URL. Tests give it the in-memory API
server of :mod:`octacloud.k8s.fakeapi` as its transport, so every request is real HTTP on the wire format.
"""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import httpx

from octacloud.core.errors import InvalidSpecError, NotFoundError, OctacloudError
from octacloud.k8s.resources import Obj

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
MERGE_PATCH = "application/merge-patch+json"


Objs = list[Obj]


class ApiError(OctacloudError):
    """The API server refused a request (``status``: its HTTP status; ``reason``: the Status reason)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"Kubernetes API: {status} {reason}: {message}")
        self.status = status
        self.reason = reason


class Conflict(ApiError):
    """409: the object exists already, or it changed since it was read."""


def pods_path(namespace: str | None = None) -> str:
    return "/api/v1/pods" if namespace is None else f"/api/v1/namespaces/{namespace}/pods"


def pod_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{namespace}/pods/{name}"


def node_path(name: str | None = None) -> str:
    return "/api/v1/nodes" if name is None else f"/api/v1/nodes/{name}"


class KubeClient:
    """A small async client of the Kubernetes API. Every method raises :class:`ApiError` on a refusal."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        verify: bool | str | ssl.SSLContext = True,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        headers = {"Accept": "application/json", "User-Agent": "octacloud"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if isinstance(verify, str):  # a CA bundle's path (httpx takes a context for it)
            try:
                verify = ssl.create_default_context(cafile=verify)
            except (OSError, ssl.SSLError) as exc:
                raise InvalidSpecError(f"cannot read the API server's CA bundle {verify}: {exc}") from None
        self._http = httpx.AsyncClient(
            base_url=base_url, headers=headers, verify=verify, transport=transport, timeout=timeout_s
        )

    @classmethod
    def in_cluster(cls, account: Path = SERVICE_ACCOUNT) -> KubeClient:
        """The client of a pod: the API server from the environment, the service account's token and CA."""
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise InvalidSpecError(
                "not running in a Kubernetes pod (KUBERNETES_SERVICE_HOST is unset); give --api-server and --token-file"
            )
        try:
            token = (account / "token").read_text().strip()
        except OSError as exc:
            raise InvalidSpecError(f"cannot read the service account token in {account}: {exc.strerror}") from None
        host = f"[{host}]" if ":" in host else host
        return cls(f"https://{host}:{port}", token=token, verify=str(account / "ca.crt"))

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def request(
        self, method: str, path: str, body: Mapping[str, Any] | None = None, *, params: Mapping[str, str] | None = None
    ) -> Obj:
        headers = {"Content-Type": MERGE_PATCH} if method == "PATCH" else {}
        try:
            response = await self._http.request(method, path, json=body, params=params, headers=headers)
        except httpx.HTTPError as exc:
            raise ApiError(0, "Unreachable", f"{method} {path}: {exc}") from None
        if response.status_code >= 300:
            raise _error(response)
        if not response.content:
            return {}
        data = response.json()
        return data if isinstance(data, dict) else {"items": data}

    async def get(self, path: str) -> Obj:
        return await self.request("GET", path)

    async def list(self, path: str, **selectors: str) -> list[Obj]:
        """Items of a collection; ``label_selector=``/``field_selector=`` filter on the server."""
        params = {_camel(k): v for k, v in selectors.items() if v}
        items = (await self.request("GET", path, params=params)).get("items") or []
        return [i for i in items if isinstance(i, dict)]

    async def list_with_version(self, path: str, **selectors: str) -> tuple[Objs, str]:
        """Items of a collection and its ``metadata.resourceVersion`` (where a :meth:`watch` of it starts)."""
        params = {_camel(k): v for k, v in selectors.items() if v}
        body = await self.request("GET", path, params=params)
        items = [i for i in body.get("items") or [] if isinstance(i, dict)]
        return items, str((body.get("metadata") or {}).get("resourceVersion") or "")

    async def watch(
        self, path: str, resource_version: str, *, timeout_s: int = 300, **selectors: str
    ) -> AsyncIterator[Obj]:
        """The watch events of a collection from ``resource_version`` on: ``{"type": "ADDED" | "MODIFIED" |
        "DELETED" | "BOOKMARK" | "ERROR", "object": ...}``, until the server ends the watch (after ``timeout_s``).

        An ``ERROR`` event carries a ``Status``; code 410 (``Expired``) means the version is too old: list again
        and watch from the new version. A refusal of the request itself raises :class:`ApiError`."""
        params = {_camel(k): v for k, v in selectors.items() if v}
        params.update(
            watch="1", resourceVersion=resource_version, allowWatchBookmarks="true", timeoutSeconds=str(timeout_s)
        )
        timeout = httpx.Timeout(self._http.timeout.connect, read=timeout_s + 30.0)
        try:
            async with self._http.stream("GET", path, params=params, timeout=timeout) as response:
                if response.status_code >= 300:
                    await response.aread()
                    raise _error(response)
                async for line in response.aiter_lines():
                    if line.strip():
                        event = json.loads(line)
                        if isinstance(event, dict):
                            yield event
        except httpx.HTTPError as exc:
            raise ApiError(0, "Unreachable", f"watch {path}: {exc}") from None

    async def create(self, path: str, body: Mapping[str, Any]) -> Obj:
        return await self.request("POST", path, body)

    async def replace(self, path: str, body: Mapping[str, Any]) -> Obj:
        return await self.request("PUT", path, body)

    async def patch(self, path: str, body: Mapping[str, Any]) -> Obj:
        """A JSON merge patch (RFC 7386): ``None`` values delete keys."""
        return await self.request("PATCH", path, body)

    async def delete(self, path: str) -> None:
        try:
            await self.request("DELETE", path)
        except ApiError as exc:
            if exc.status != 404:
                raise

    async def bind(self, namespace: str, name: str, uid: str, node: str) -> None:
        """Bind a pod to a node (the ``binding`` subresource, as kube-scheduler does)."""
        body: Obj = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name, "namespace": namespace, **({"uid": uid} if uid else {})},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        await self.create(f"{pod_path(namespace, name)}/binding", body)


def _camel(snake: str) -> str:
    head, *rest = snake.split("_")
    return head + "".join(p.title() for p in rest)


def _error(response: httpx.Response) -> ApiError:
    reason, message = response.reason_phrase, response.text[:500]
    try:
        status = response.json()
        if isinstance(status, dict):
            reason, message = str(status.get("reason") or reason), str(status.get("message") or message)
    except ValueError:
        pass
    request = response.request
    message = f"{request.method} {request.url.path}: {message}"
    if response.status_code == 404:
        return _NotFound(404, reason, message)
    if response.status_code == 409:
        return Conflict(409, reason, message)
    return ApiError(response.status_code, reason, message)


class _NotFound(ApiError, NotFoundError):
    """404."""


def is_not_found(exc: BaseException) -> bool:
    return isinstance(exc, ApiError) and exc.status == 404
