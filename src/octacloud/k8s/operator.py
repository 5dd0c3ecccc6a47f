"""The ``InferenceDeployment`` custom resource (``octacloud.io/v1alpha1``), reconciled into a Deployment of replica
pods that request octants, a Service, and a status.

An ``InferenceDeployment`` says what ``octacloud deploy`` says: a model (and version) from the repository, octants
per replica (1..8, a multiple of 8 for whole cards, or ``auto``: sized from the model's footprint), a replica
count or a target QPS and latency SLO (sized from the model's profile), a priority class and a tenant. The
operator turns it into:

- a ``Deployment`` whose pods run ``octacloud serve`` on the model, ask for ``octacloud.io/octants`` (so the
  scheduler extender places them and the device plugin binds them to their slice), and roll out make-before-break
  (``maxSurge: 1``, ``maxUnavailable: 0``: a new replica is ready before an old one stops, as in the cloud);
- a ``Service`` in front of the ready replicas (REST 8000, gRPC 8001, metrics 8002);
- ``status``: replicas, ready replicas, octants, and each pod's placement (node and cards) as the extender
  recorded it.

:func:`reconcile` is plain async code over :class:`~octacloud.k8s.api.KubeClient`; :func:`register_handlers`
hands it to kopf, which watches the resources and retries failures with back-off.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from octacloud.control.deployments import DeploymentSpec
from octacloud.control.sizing import ModelFootprint, size_deployment
from octacloud.core.errors import InvalidSpecError, NotFoundError
from octacloud.k8s.api import ApiError, KubeClient, is_not_found, node_path, pods_path
from octacloud.k8s.resources import (
    GPU_COUNT_LABEL,
    GPU_MEMORY,
    GPU_MEMORY_LABEL,
    OCTANTS,
    TENANT_LABEL,
    Obj,
    pod_placement,
)
from octacloud.storage.sizes import parse_size

log = logging.getLogger("octacloud.k8s.operator")

GROUP, VERSION, PLURAL, KIND = "octacloud.io", "v1alpha1", "inferencedeployments", "InferenceDeployment"
API_VERSION = f"{GROUP}/{VERSION}"
NAME_LABEL = "octacloud.io/inference-deployment"
DEFAULT_IMAGE = "ghcr.io/octacloud/octacloud:0.1.0"
SCHEDULER_NAME = "octacloud"
"""The kube-scheduler profile that calls octacloud's extender (deploy/k8s/config/scheduler-config.yaml)."""
MODELS_MOUNT = "/models"
SPEC_KEYS = (
    "model",
    "version",
    "octants",
    "replicas",
    "minReplicas",
    "maxReplicas",
    "targetQPS",
    "sloMs",
    "priorityClassName",
    "schedulerName",
    "tenant",
    "image",
    "modelsClaim",
    "modelStorage",
    "storageSecret",
    "cacheSize",
)
NODE_CACHE_HOST_PATH = "/var/lib/octacloud/model-cache"
"""With ``modelStorage``: every node's model cache, shared by the pods on that node (a hostPath)."""
NODE_CACHE_MOUNT = "/var/cache/octacloud/models"
STORAGE_SECRET_MOUNT = "/etc/octacloud/storage"
"""With ``storageSecret``: the Secret's ``credentials`` key (an AWS shared-credentials file) is mounted here."""

FootprintSource = Callable[[str], ModelFootprint]


def resource_path(namespace: str, name: str | None = None, sub: str | None = None) -> str:
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"
    return path + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")


@dataclass(frozen=True, slots=True)
class Desired:
    """What an InferenceDeployment resolves to."""

    name: str
    namespace: str
    spec: DeploymentSpec
    octants: int
    replicas: int
    memory_mib: int
    priority_class: str
    image: str
    models_claim: str
    scheduler_name: str = SCHEDULER_NAME
    model_storage: str = ""
    """The model store pods fetch from through the node cache ('' : the ``modelsClaim`` PVC, read in place)."""
    storage_secret: str = ""
    cache_size: str = ""


def parse(obj: Mapping[str, Any], footprint: FootprintSource | None, card_memory_mib: int | None) -> Desired:
    """Validate an InferenceDeployment and resolve its size; errors name the field."""
    meta = obj.get("metadata") or {}
    name, namespace = str(meta.get("name", "")), str(meta.get("namespace") or "default")
    where = f"{KIND} {namespace}/{name}"
    spec = _known_spec(obj, where)
    ds, replicas = _deployment_spec(spec, name, where)
    fp = _footprint(footprint, ds.model, where)
    octants, count = _size(ds, replicas, fp, card_memory_mib, where)
    return Desired(
        name,
        namespace,
        ds,
        octants,
        count,
        0 if fp is None else fp.memory_mib,
        str(spec.get("priorityClassName", "")),
        str(spec.get("image", DEFAULT_IMAGE)),
        str(spec.get("modelsClaim", "octacloud-models")),
        str(spec.get("schedulerName", SCHEDULER_NAME)),
        *_storage_fields(spec, where),
    )


def _known_spec(obj: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    """The resource's spec, present and with no field the operator does not know."""
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        raise InvalidSpecError(f"{where}: spec is missing")
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise InvalidSpecError(f"{where}: unknown spec field(s) {unknown}; allowed: {list(SPEC_KEYS)}")
    return spec


def _deployment_spec(spec: Mapping[str, Any], name: str, where: str) -> tuple[DeploymentSpec, Any]:
    """The deployment the spec asks for, and its fixed ``replicas`` (None: sized from ``targetQPS`` or the bounds)."""
    model = spec.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidSpecError(f"{where}: spec.model must name a model of the repository")
    raw_octants = spec.get("octants", 1)
    if raw_octants != "auto" and (isinstance(raw_octants, bool) or not isinstance(raw_octants, int)):
        raise InvalidSpecError(f"{where}: spec.octants must be 1..8, a multiple of 8, or 'auto'; got {raw_octants!r}")
    replicas = spec.get("replicas")
    target = spec.get("targetQPS")
    if replicas is not None and target is not None:
        raise InvalidSpecError(f"{where}: give spec.replicas or spec.targetQPS (with sloMs), not both")
    lo = int(spec.get("minReplicas", replicas if replicas is not None else 1))
    hi = int(spec.get("maxReplicas", replicas if replicas is not None else max(lo, 1)))
    try:
        ds = DeploymentSpec(
            name=name,
            model=model,
            version=str(spec.get("version", "")),
            octants=None if raw_octants == "auto" else int(raw_octants),
            min_replicas=lo,
            max_replicas=hi,
            target_qps=None if target is None else float(target),
            slo_ms=None if spec.get("sloMs") is None else float(spec["sloMs"]),
            tenant=str(spec.get("tenant", "default")),
        )
    except (TypeError, ValueError) as exc:
        raise InvalidSpecError(f"{where}: {exc}") from None
    return ds, replicas


def _size(
    ds: DeploymentSpec, replicas: Any, fp: ModelFootprint | None, card_memory_mib: int | None, where: str
) -> tuple[int, int]:
    """``(octants, replicas)``: as given, or sized from the footprint for octants 'auto' or a ``targetQPS``."""
    octants = ds.octants
    count = replicas if replicas is not None else ds.min_replicas
    if ds.octants is None or ds.target_qps is not None:
        if fp is None or not card_memory_mib:
            raise InvalidSpecError(
                f"{where}: octants 'auto' and targetQPS need the model repository and the fleet's card memory "
                "(run the operator with --repository, on a cluster whose nodes octacloud's device plugin labelled)"
            )
        sizing = size_deployment(
            fp, card_memory_mib, target_qps=ds.target_qps, min_replicas=ds.min_replicas, max_replicas=ds.max_replicas
        )
        octants = ds.octants or sizing.octants
        count = sizing.replicas
    assert octants is not None
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise InvalidSpecError(f"{where}: spec.replicas must be an integer >= 0, got {count!r}")
    return octants, count


def _footprint(footprint: FootprintSource | None, model: str, where: str) -> ModelFootprint | None:
    """The model's footprint (None without a repository); with a repository the model must be in it
    (NotFoundError: asked again later). Errors name the resource."""
    if footprint is None:
        return None
    try:
        return footprint(model)
    except NotFoundError as exc:
        raise NotFoundError(f"{where}: {exc}") from None
    except InvalidSpecError as exc:
        raise InvalidSpecError(f"{where}: {exc}") from None


def _storage_fields(spec: Mapping[str, Any], where: str) -> tuple[str, str, str]:
    """``modelStorage``, ``storageSecret``, ``cacheSize``, checked."""
    storage, secret, size = (spec.get(k, "") for k in ("modelStorage", "storageSecret", "cacheSize"))
    for key, value in (("modelStorage", storage), ("storageSecret", secret), ("cacheSize", size)):
        if not isinstance(value, str):
            raise InvalidSpecError(f"{where}: spec.{key} must be a string, got {value!r}")
    if (secret or size) and not storage:
        raise InvalidSpecError(f"{where}: spec.storageSecret and spec.cacheSize go with spec.modelStorage")
    if size:
        parse_size(size, f"{where}: spec.cacheSize")
    return storage, secret, size


def owner_reference(obj: Mapping[str, Any]) -> Obj:
    meta = obj.get("metadata") or {}
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": meta.get("name"),
        "uid": meta.get("uid"),
        "controller": True,
        "blockOwnerDeletion": True,
    }


def deployment_for(d: Desired, owner: Obj) -> Obj:
    """The apps/v1 Deployment of ``d``'s replicas."""
    labels = {NAME_LABEL: d.name, TENANT_LABEL: d.spec.tenant, "app.kubernetes.io/managed-by": "octacloud"}
    annotations = {GPU_MEMORY: str(d.memory_mib)} if d.memory_mib else {}
    command = [
        "octacloud",
        "serve",
        "--repository",
        MODELS_MOUNT,
        "--host",
        "0.0.0.0",
        "--model-control-mode",
        "explicit",
        "--load-model",
        d.spec.model,
    ]
    mounts: list[Obj] = [{"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True}]
    volumes: list[Obj] = [{"name": "models", "persistentVolumeClaim": {"claimName": d.models_claim, "readOnly": True}}]
    if d.model_storage:
        command, mounts, volumes = _node_cache(d)
    container: Obj = {
        "name": "replica",
        "image": d.image,
        "command": command,
        "ports": [
            {"name": "http", "containerPort": 8000},
            {"name": "grpc", "containerPort": 8001},
            {"name": "metrics", "containerPort": 8002},
        ],
        "resources": {"limits": {OCTANTS: str(d.octants)}},
        "readinessProbe": {"httpGet": {"path": "/v2/health/ready", "port": "http"}, "periodSeconds": 2},
        "livenessProbe": {"httpGet": {"path": "/v2/health/live", "port": "http"}, "periodSeconds": 10},
        "volumeMounts": mounts,
    }
    pod_spec: Obj = {
        "schedulerName": d.scheduler_name,
        "containers": [container],
        "volumes": volumes,
    }
    if d.priority_class:
        pod_spec["priorityClassName"] = d.priority_class
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": d.name, "namespace": d.namespace, "labels": labels, "ownerReferences": [owner]},
        "spec": {
            "replicas": d.replicas,
            "selector": {"matchLabels": {NAME_LABEL: d.name}},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod_spec},
        },
    }


def _node_cache(d: Desired) -> tuple[list[str], list[Obj], list[Obj]]:
    """The replica's command, mounts and volumes when it fetches from ``modelStorage`` through its node's cache
    (as KServe's LocalModelCache keeps models on the node): the cache is a hostPath every pod on the node shares
    (one download per node, ``flock``s and leases work across pods), the one-model view a scratch emptyDir."""
    command = ["octacloud", "serve", "--repository", "/scratch/repository", "--host", "0.0.0.0",
               "--model-storage", d.model_storage, "--model-cache", NODE_CACHE_MOUNT, "--fetch-model", d.spec.model,
               "--fetch-version", d.spec.version, "--serve-as", d.spec.model]  # fmt: skip
    if d.cache_size:
        command += ["--model-cache-size", d.cache_size]
    mounts: list[Obj] = [{"name": "model-cache", "mountPath": NODE_CACHE_MOUNT},
                         {"name": "scratch", "mountPath": "/scratch"}]  # fmt: skip
    volumes: list[Obj] = [
        {"name": "model-cache", "hostPath": {"path": NODE_CACHE_HOST_PATH, "type": "DirectoryOrCreate"}},
        {"name": "scratch", "emptyDir": {}},
    ]
    if d.storage_secret:
        command += ["--storage-credentials", f"{STORAGE_SECRET_MOUNT}/credentials"]
        mounts.append({"name": "storage-credentials", "mountPath": STORAGE_SECRET_MOUNT, "readOnly": True})
        volumes.append({"name": "storage-credentials", "secret": {"secretName": d.storage_secret}})
    return command, mounts, volumes


def service_for(d: Desired, owner: Obj) -> Obj:
    ports = [
        {"name": n, "port": p, "targetPort": n, "protocol": "TCP"}
        for n, p in (("http", 8000), ("grpc", 8001), ("metrics", 8002))
    ]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": d.name,
            "namespace": d.namespace,
            "labels": {NAME_LABEL: d.name},
            "ownerReferences": [owner],
        },
        "spec": {"selector": {NAME_LABEL: d.name}, "ports": ports},
    }


async def apply(api: KubeClient, collection: str, desired: Obj) -> str:
    """Create ``desired`` or merge-patch the live object to it; returns 'created', 'updated' or 'unchanged'."""
    name = desired["metadata"]["name"]
    try:
        live = await api.get(f"{collection}/{name}")
    except ApiError as exc:
        if not is_not_found(exc):
            raise
        await api.create(collection, desired)
        return "created"
    owner = desired["metadata"]["ownerReferences"][0]
    owners = (live.get("metadata") or {}).get("ownerReferences") or []
    if not any(o.get("uid") == owner["uid"] and o.get("kind") == owner["kind"] for o in owners):
        raise InvalidSpecError(
            f"{live.get('kind', 'object')} {desired['metadata']['namespace']}/{name} exists and does not belong to "
            f"{owner['kind']} {name}; octacloud will not take it over (rename one of them)"
        )
    if _contains(live, {"metadata": {"labels": desired["metadata"]["labels"]}, "spec": desired["spec"]}):
        return "unchanged"
    await api.patch(
        f"{collection}/{name}", {"metadata": {"labels": desired["metadata"]["labels"]}, "spec": desired["spec"]}
    )
    return "updated"


def _contains(live: Any, want: Any) -> bool:
    if isinstance(want, Mapping):
        return isinstance(live, Mapping) and all(_contains(live.get(k), v) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(live, list) and len(live) == len(want) and all(map(_contains, live, want))
    return bool(live == want)


async def card_memory(api: KubeClient) -> int | None:
    """The largest card memory among the nodes octacloud's device plugin labelled."""
    best = 0
    for n in await api.list(node_path(), label_selector=GPU_COUNT_LABEL):
        labels = (n.get("metadata") or {}).get("labels") or {}
        try:
            best = max(best, int(labels.get(GPU_MEMORY_LABEL, 0)))
        except ValueError:
            continue
    return best or None


async def reconcile(api: KubeClient, obj: Mapping[str, Any], footprint: FootprintSource | None = None) -> Obj:
    """Make the Deployment and Service match ``obj``; return its new ``status``. Raises InvalidSpecError for a
    spec that can never work (kopf reports it without retrying), NotFoundError for a model the repository does
    not hold (reported and asked again) and ApiError for the API (kopf retries)."""
    d = parse(obj, footprint, await card_memory(api) if footprint is not None else None)
    owner = owner_reference(obj)
    deployment = await apply(api, f"/apis/apps/v1/namespaces/{d.namespace}/deployments", deployment_for(d, owner))
    await apply(api, f"/api/v1/namespaces/{d.namespace}/services", service_for(d, owner))
    if deployment != "unchanged":
        log.info("%s/%s: deployment %s (%d × %d octants)", d.namespace, d.name, deployment, d.replicas, d.octants)
    return await observe(api, d, obj)


async def observe(api: KubeClient, d: Desired, obj: Mapping[str, Any]) -> Obj:
    """The status: replica counts from the Deployment, placements from the pods' annotations."""
    try:
        live = await api.get(f"/apis/apps/v1/namespaces/{d.namespace}/deployments/{d.name}")
    except ApiError as exc:
        if not is_not_found(exc):
            raise
        live = {}
    status = live.get("status") or {}
    placements = []
    for pod in await api.list(pods_path(d.namespace), label_selector=f"{NAME_LABEL}={d.name}"):
        p = pod_placement(pod)
        meta = pod.get("metadata") or {}
        placements.append(
            {
                "pod": meta.get("name"),
                "node": p.node if p else "",
                "cards": list(p.gpus) if p else [],
                "phase": (pod.get("status") or {}).get("phase", ""),
            }
        )
    ready = int(status.get("readyReplicas") or 0)
    return {
        "replicas": d.replicas,
        "readyReplicas": ready,
        "updatedReplicas": int(status.get("updatedReplicas") or 0),
        "octants": d.octants,
        "octantsTotal": d.octants * d.replicas,
        "placements": sorted(placements, key=lambda p: str(p["pod"])),
        "observedGeneration": (obj.get("metadata") or {}).get("generation", 0),
        "phase": "Ready" if ready >= d.replicas else "Progressing",
        "message": "",
        "conditions": [
            condition("Valid", True, "Reconciled", f"a Deployment of {d.replicas} x {d.octants} octants"),
            condition("Ready", ready >= d.replicas, "ReplicasReady", f"{ready} of {d.replicas} replicas ready"),
        ],
    }


def condition(kind: str, ok: bool, reason: str, message: str) -> Obj:
    """A status condition as Kubernetes objects carry them (``kubectl wait --for=condition=Ready`` reads it)."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"type": kind, "status": "True" if ok else "False", "reason": reason, "message": message,
            "lastTransitionTime": now}  # fmt: skip


def _refused(patch: Any, reason: str, message: str) -> None:
    patch.status["phase"], patch.status["message"] = "Invalid", message
    patch.status["conditions"] = [condition("Valid", False, reason, message), condition("Ready", False, reason, "")]


def register_handlers(
    api_factory: Callable[[], KubeClient], footprint: FootprintSource | None = None, registry: Any = None
) -> None:
    """Register kopf handlers (in ``registry``, default kopf's): create, update and resume reconcile; a timer
    reconciles again every 10 s (level-triggered: drift is repaired) and refreshes the status."""
    import kopf

    resource = (GROUP, VERSION, PLURAL)

    async def handle(body: Mapping[str, Any], patch: Any) -> None:
        api = api_factory()
        try:
            status = await reconcile(api, body, footprint)
        except InvalidSpecError as exc:  # never works as written: said once, until the spec changes
            _refused(patch, "InvalidSpec", str(exc))
            raise kopf.PermanentError(str(exc)) from None
        except NotFoundError as exc:  # the model may be published later: said, and asked again
            _refused(patch, "ModelNotFound", str(exc))
            raise kopf.TemporaryError(str(exc), delay=30) from None
        except ApiError as exc:
            raise kopf.TemporaryError(str(exc), delay=5) from None
        finally:
            await api.close()
        patch.status.update(status)

    async def on_change(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
        await handle(body, patch)

    kopf.on.create(*resource, registry=registry)(on_change)
    kopf.on.update(*resource, field="spec", registry=registry)(on_change)
    kopf.on.resume(*resource, registry=registry)(on_change)
    kopf.timer(*resource, interval=10.0, idle=5.0, registry=registry)(on_change)
