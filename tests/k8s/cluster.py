"""A real Kubernetes control plane for the end-to-end tests: ``scripts/k8s-control-plane`` started on loopback,
kube-schedulers with the configuration ``deploy/k8s/`` ships, nodes registered through the API, the extender as
the process a user runs, and small waiting helpers.

The binaries come from ``OCTACLOUD_K8S_BIN`` (see ``scripts/k8s-control-plane``); where they cannot be had the
fixture fails with the script's message saying how to get them.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml

from octacloud.core.model import Node
from octacloud.k8s.api import ApiError, KubeClient, is_not_found, node_path
from octacloud.k8s.deviceplugin import publish_node
from octacloud.k8s.resources import GPUS, OCTANTS, Obj

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "k8s-control-plane"
DEPLOY = ROOT / "deploy" / "k8s"
NOT_READY = "node.kubernetes.io/not-ready"
T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, env=env, check=False)


@dataclass
class ControlPlane:
    """etcd, kube-apiserver and kube-controller-manager from ``scripts/k8s-control-plane``, with schedulers and
    hollow nodes added on demand; everything is stopped by PID in :meth:`stop`."""

    state: Path
    ports: dict[str, int]
    version: tuple[int, int] = (0, 0)
    extender_port: int = field(default_factory=free_port)
    """Where every scheduler started by :meth:`scheduler` calls the extender."""

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.ports['api']}"

    @property
    def token(self) -> str:
        return (self.state / "admin.token").read_text().strip()

    @property
    def token_file(self) -> Path:
        return self.state / "admin.token"

    @property
    def ca(self) -> Path:
        return self.state / "pki" / "ca.crt"

    @property
    def kubeconfig(self) -> Path:
        return self.state / "kubeconfig"

    def client(self) -> KubeClient:
        return KubeClient(self.url, token=self.token, verify=str(self.ca))

    def api_flags(self) -> list[str]:
        """The flags octacloud's k8s commands take to reach this API server."""
        return ["--api-server", self.url, "--token-file", str(self.token_file), "--ca-file", str(self.ca)]

    def scheduler_config(self, name: str, *, node_cache: bool = True) -> Path:
        """``deploy/k8s/config/scheduler-config.yaml`` as shipped, pointed at this control plane and the test's
        extender: the API version matched to the server, a local kubeconfig, no leader election, profile ``name``."""
        config = yaml.safe_load((DEPLOY / "config" / "scheduler-config.yaml").read_text())
        config["apiVersion"] = "kubescheduler.config.k8s.io/" + ("v1" if self.version >= (1, 25) else "v1beta1")
        config["clientConnection"] = {"kubeconfig": str(self.kubeconfig)}
        config["leaderElection"] = {"leaderElect": False}
        config["profiles"] = [{"schedulerName": name}]
        for ext in config["extenders"]:
            ext["urlPrefix"] = f"http://127.0.0.1:{self.extender_port}"
            ext["nodeCacheCapable"] = node_cache
        path = self.state / f"scheduler-{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def scheduler(self, name: str, config: Path) -> int:
        """Start a kube-scheduler with ``config``; returns its secure port (metrics)."""
        port = free_port()
        self._script("scheduler", str(self.state), name, str(config), K8S_SCHEDULER_PORT=str(port))
        return port

    def hollow_node(self, name: str, *flags: str) -> None:
        """A kubemark hollow node: the kubelet's code with a fake container runtime, registered by itself."""
        self._script("hollow-node", str(self.state), name, *flags, K8S_KUBELET_PORT=str(free_port()))

    def stop_process(self, name: str) -> None:
        """Stop one process the script started (``scheduler-NAME``, ``hollow-NAME``), by its PID."""
        pidfile = self.state / "pids" / name
        pid = int(pidfile.read_text())
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        pidfile.unlink()

    def stop(self) -> None:
        _run("stop", str(self.state))

    def _script(self, *args: str, **env: str) -> None:
        done = _run(*args, env={**os.environ, **env})
        if done.returncode != 0:
            raise RuntimeError(f"scripts/k8s-control-plane {args[0]} failed:\n{done.stderr}")


def start_control_plane(state: Path) -> ControlPlane:
    """Start etcd, kube-apiserver and kube-controller-manager in ``state``; fail (not skip) with the script's
    message when the binaries or etcd cannot be had."""
    found = _run("binaries")
    if found.returncode != 0:
        pytest.fail(found.stderr.strip(), pytrace=False)
    names = ("etcd", "etcd_peer", "api", "kcm")
    ports = {n: free_port() for n in names}
    env = {
        **os.environ,
        "K8S_ETCD_PORT": str(ports["etcd"]),
        "K8S_ETCD_PEER_PORT": str(ports["etcd_peer"]),
        "K8S_API_PORT": str(ports["api"]),
        "K8S_KCM_PORT": str(ports["kcm"]),
        "K8S_OWNER_PID": str(os.getpid()),  # this test run killed: the watchdog stops it all
    }
    done = _run("start", str(state), env=env)
    if done.returncode != 0:
        _run("stop", str(state))
        pytest.fail(f"scripts/k8s-control-plane start failed:\n{done.stderr}", pytrace=False)
    cp = ControlPlane(state, ports)
    context = ssl.create_default_context(cafile=str(cp.ca))
    version = httpx.get(f"{cp.url}/version", headers={"Authorization": f"Bearer {cp.token}"}, verify=context)
    info = version.json()
    cp.version = (int(info["major"]), int("".join(c for c in info["minor"] if c.isdigit())))
    return cp


# ---- waiting ---------------------------------------------------------------------------------------------


async def eventually(probe: Callable[[], Awaitable[T | None]], what: str, timeout_s: float = 90.0) -> T:
    """Poll ``probe`` until it returns something other than None/False; fail naming ``what`` after ``timeout_s``
    (a bound against a hang, never a measure of speed)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last: Any = None
    while loop.time() < deadline:
        last = await probe()
        if last is not None and last is not False:
            return last
        await asyncio.sleep(0.2)
    raise AssertionError(f"gave up waiting for {what} (last seen: {last!r})")


# ---- nodes -----------------------------------------------------------------------------------------------


def node_object(node: Node) -> Obj:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node.name, "labels": _base_labels(node.name)}}


def _base_labels(name: str) -> dict[str, str]:
    return {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}


def node_status(node: Node) -> Obj:
    """What a kubelet reports: capacity and allocatable with the device plugin's resources, and Ready."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    capacity = {
        "cpu": str(node.cpu_milli // 1000),
        "memory": f"{node.memory_mib}Mi",
        "pods": "110",
        OCTANTS: str(8 * node.gpu_count),
        GPUS: str(node.gpu_count),
    }
    ready = {
        "type": "Ready",
        "status": "True",
        "reason": "KubeletReady",
        "message": "registered through the API by the test",
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }
    return {"capacity": capacity, "allocatable": capacity, "conditions": [ready]}


async def register_nodes(api: KubeClient, nodes: list[Node]) -> None:
    """Create each node, report its status as its kubelet would, label it as octacloud's device plugin does,
    and wait until the controller-manager has removed the not-ready taint every new node carries."""
    for node in nodes:
        await api.create(node_path(), node_object(node))
        await api.patch(f"{node_path(node.name)}/status", {"status": node_status(node)})
        await publish_node(api, node, [g.health for g in node.gpus])

    async def untainted() -> bool:
        for node in nodes:
            obj = await api.get(node_path(node.name))
            if any(t.get("key") == NOT_READY for t in (obj.get("spec") or {}).get("taints") or []):
                return False
        return True

    await eventually(untainted, f"the not-ready taint to leave nodes {[n.name for n in nodes]}")


async def delete_nodes(api: KubeClient, names: list[str]) -> None:
    for name in names:
        await api.delete(node_path(name))


# ---- namespaces and pods ---------------------------------------------------------------------------------


async def namespace(api: KubeClient, name: str) -> None:
    """Create a namespace and wait for its ``default`` service account (pods are refused until it exists)."""
    await api.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})

    async def account() -> bool:
        try:
            await api.get(f"/api/v1/namespaces/{name}/serviceaccounts/default")
        except Exception as exc:
            if is_not_found(exc):
                return False
            raise
        return True

    await eventually(account, f"the default service account of namespace {name}")


def pod_manifest(
    name: str,
    *,
    octants: int | None = None,
    gpus: int | None = None,
    scheduler: str = "octacloud",
    priority_class: str = "",
    annotations: dict[str, str] | None = None,
    node: str = "",
    cpu: str = "100m",
) -> Obj:
    """A pod as a user writes it. Its grace period is 0: on a node registered through the API no kubelet would
    confirm a graceful deletion."""
    limits: Obj = {"cpu": cpu, "memory": "64Mi"}
    if octants is not None:
        limits[OCTANTS] = str(octants)
    if gpus is not None:
        limits[GPUS] = str(gpus)
    spec: Obj = {
        "schedulerName": scheduler,
        "terminationGracePeriodSeconds": 0,
        "containers": [{"name": "model", "image": "octacloud/replica:test", "resources": {"limits": limits}}],
    }
    if priority_class:
        spec["priorityClassName"] = priority_class
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": spec,
    }


# ---- the extender, as its users run it ---------------------------------------------------------------------


@dataclass
class ExtenderProcess:
    """``octacloud k8s extender`` as a separate process on the port the schedulers call."""

    cp: ControlPlane
    args: list[str] = field(default_factory=list)
    log: Path | None = None
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "octacloud", "k8s", "extender", "--port", str(self.cp.extender_port)]
        self.log = self.cp.state / "logs" / f"extender-{self.cp.extender_port}.log"
        with self.log.open("ab") as out:
            self.process = subprocess.Popen([*cmd, *self.cp.api_flags(), *self.args], stdout=out, stderr=out)
        url = f"http://127.0.0.1:{self.cp.extender_port}/healthz"
        for _ in range(600):
            if self.process.poll() is not None:
                raise RuntimeError(f"the extender exited: {self.log.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=1).status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError("the extender did not answer /healthz")

    def health(self) -> dict[str, Any]:
        return dict(httpx.get(f"http://127.0.0.1:{self.cp.extender_port}/healthz", timeout=5).json())

    def placements(self) -> dict[str, Any]:
        return dict(httpx.get(f"http://127.0.0.1:{self.cp.extender_port}/placements", timeout=5).json())

    def kill(self, sig: int = signal.SIGKILL) -> None:
        assert self.process is not None
        self.process.send_signal(sig)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.kill(signal.SIGTERM)


class OperatorProcess:
    """``octacloud k8s operator`` as a user runs it (kopf logs in with the kubeconfig; octacloud's client with the
    API flags)."""

    def __init__(self, cp: ControlPlane, repository: Path) -> None:
        self.cp, self.repository = cp, repository
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "octacloud", "k8s", "operator", "--repository", str(self.repository)]
        log = self.cp.state / "logs" / "operator.log"
        env = {**os.environ, "KUBECONFIG": str(self.cp.kubeconfig)}
        with log.open("ab") as out:
            self.process = subprocess.Popen([*cmd, *self.cp.api_flags()], stdout=out, stderr=out, env=env)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        assert self.process is not None
        self.process.send_signal(sig)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.kill(signal.SIGTERM)


@contextlib.contextmanager
def extender_process(cp: ControlPlane, *args: str) -> Iterator[ExtenderProcess]:
    ext = ExtenderProcess(cp, list(args))
    ext.start()
    try:
        yield ext
    finally:
        ext.stop()


# ---- manifests -------------------------------------------------------------------------------------------


async def apply_manifest(api: KubeClient, doc: Obj) -> Obj:
    """Create ``doc`` as ``kubectl apply`` would the first time: its collection found through the API's
    discovery (so custom resources work once their CRD is established); an object that exists is left as it is."""
    group_version, kind = str(doc["apiVersion"]), str(doc["kind"])
    base = f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"
    resources = (await api.get(base)).get("resources") or []
    found = [r for r in resources if r.get("kind") == kind and "/" not in str(r.get("name"))]
    if not found:
        raise AssertionError(f"the API server has no {kind} in {group_version}")
    meta = doc.get("metadata") or {}
    path = base
    if found[0].get("namespaced"):
        path += f"/namespaces/{meta.get('namespace') or 'default'}"
    path += f"/{found[0]['name']}"
    try:
        return await api.create(path, doc)
    except ApiError as exc:
        if exc.status != 409:
            raise
        return await api.get(f"{path}/{meta['name']}")
