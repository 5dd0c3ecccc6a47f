"""Kubernetes pods of an ``InferenceDeployment`` with ``modelStorage``, run as a kubelet runs them: the operator's
pod template, its volumes made folders (the node cache's hostPath one folder per node, shared by that node's
pods; an emptyDir per pod; the credentials Secret a file), its container's command run as a process against a
real S3 store (SeaweedFS on loopback). Two pods on one node download the model once and serve; with the store
killed, a pod killed with ``kill -9`` comes back from its node's cache, and a pod on a node that never held the
model fails with the store's name and the reason."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from octacloud.k8s.operator import deployment_for, owner_reference, parse
from octacloud.storage.publish import publish_folder
from octacloud.storage.store import open_store
from tests.cluster.conftest import IN, expected_output, write_linear_model
from tests.ray.harness import wait_until
from tests.storage.seaweed import SeaweedS3, _free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Pod:
    name: str
    folder: Path
    port: int
    process: subprocess.Popen[bytes]

    def ready(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/v2/health/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def fetch(self) -> dict[str, Any]:
        """What the pod's fetch reported (written beside its one-model view, in its scratch emptyDir)."""
        return dict(json.loads((self.folder / "volumes" / "scratch" / "fetch.json").read_text()))

    def log(self) -> str:
        return (self.folder / "log").read_text()


class Kubelet:
    """One node: runs pods from a Deployment's template, with the node's hostPath folders shared by its pods."""

    def __init__(self, root: Path, secrets: dict[str, bytes]) -> None:
        self.root, self.secrets, self.pods = root, secrets, list[Pod]()

    def host_path(self, path: str) -> Path:
        return self.root / "host" / path.lstrip("/")

    def run(self, template: dict[str, Any], name: str) -> Pod:
        spec = template["spec"]
        folder = self.root / "pods" / name
        volumes: dict[str, Path] = {}
        for volume in spec["volumes"]:
            if "hostPath" in volume:
                assert volume["hostPath"]["type"] == "DirectoryOrCreate"
                volumes[volume["name"]] = self.host_path(volume["hostPath"]["path"])
            elif "emptyDir" in volume:
                volumes[volume["name"]] = folder / "volumes" / volume["name"]
            elif "secret" in volume:
                volumes[volume["name"]] = folder / "volumes" / volume["name"]
                (volumes[volume["name"]]).mkdir(parents=True, exist_ok=True)
                (volumes[volume["name"]] / "credentials").write_bytes(self.secrets[volume["secret"]["secretName"]])
            else:
                raise AssertionError(f"a volume this kubelet cannot make: {volume}")
            volumes[volume["name"]].mkdir(parents=True, exist_ok=True)
        (container,) = spec["containers"]
        mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
        port = _free_port()
        argv = [_in_pod(arg, mounts) for arg in container["command"]]
        assert argv[:2] == ["octacloud", "serve"], argv
        host = argv.index("--host") + 1
        argv[host] = "127.0.0.1"  # a pod's own network namespace binds 0.0.0.0; here every pod shares loopback
        argv = [sys.executable, "-m", "octacloud", *argv[1:], "--http-port", str(port), "--grpc-port", "-1",
                "--metrics-port", "-1", "--threads", "1"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        with (folder / "log").open("wb") as log:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        pod = Pod(name, folder, port, process)
        self.pods.append(pod)
        return pod

    def stop(self) -> None:
        for pod in self.pods:
            if pod.process.poll() is None:
                pod.process.kill()
            pod.process.wait(timeout=30)


def _in_pod(arg: str, mounts: dict[str, Path]) -> str:
    """``arg`` with a path under a mount point rewritten to the folder behind it."""
    for mount, folder in sorted(mounts.items(), key=lambda m: -len(m[0])):
        if arg == mount or arg.startswith(mount + "/"):
            return str(folder) + arg[len(mount) :]
    return arg


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[SeaweedS3, bytes, int]]:
    server = SeaweedS3(tmp_path / "s3")
    server.start()
    try:
        server.create_bucket("models")
        credentials = server.credentials_file(tmp_path / "credentials")
        local = tmp_path / "local"
        write_linear_model(local, "linear")
        publish_folder(open_store("s3://models/prod", credentials), local)
        size = sum(p.stat().st_size for p in (local / "linear" / "1").iterdir())
        yield server, credentials.read_bytes(), size
    finally:
        server.stop()


def infer(pod: Pod) -> np.ndarray:
    x = np.ones((1, IN), np.float32)
    body = {"inputs": [{"name": "INPUT0", "shape": [1, IN], "datatype": "FP32", "data": x.ravel().tolist()}]}
    answer = httpx.post(f"http://127.0.0.1:{pod.port}/v2/models/linear/infer", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    got = np.array(answer.json()["outputs"][0]["data"], np.float32).reshape(1, -1)
    np.testing.assert_allclose(got, expected_output(x), rtol=1e-5, atol=1e-5)
    return got


def test_pods_on_a_node_share_its_cache_and_start_from_it_with_the_store_down(
    store: tuple[SeaweedS3, bytes, int], tmp_path: Path
) -> None:
    server, secret, size = store
    cr = {
        "apiVersion": "octacloud.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "lin", "namespace": "ml", "uid": "u-1"},
        "spec": {"model": "linear", "octants": 1, "replicas": 2, "modelStorage": "s3://models/prod",
                 "storageSecret": "s3-creds", "cacheSize": "64MiB"},
    }  # fmt: skip
    template = deployment_for(parse(cr, None, None), owner_reference(cr))["spec"]["template"]
    node_a, node_b = (Kubelet(tmp_path / name, {"s3-creds": secret}) for name in ("gpu-a", "gpu-b"))
    try:
        first = [node_a.run(template, f"lin-{k}") for k in range(2)]  # the ReplicaSet's two pods, started at once
        for pod in first:
            wait_until(f"{pod.name} ready", lambda pod=pod: pod.ready() or pod.process.poll() is not None)
            assert pod.ready(), pod.log()
            infer(pod)
        fetched = [pod.fetch() for pod in first]
        assert sorted(bool(f["hit"]) for f in fetched) == [False, True]
        assert sum(int(f["bytes"]) for f in fetched) == size  # one download for the node, however many pods

        server.kill()
        victim = first[0]
        os.kill(victim.process.pid, signal.SIGKILL)
        victim.process.wait(timeout=30)
        infer(first[1])  # the pod that runs keeps serving
        again = node_a.run(template, "lin-2")  # the ReplicaSet replaces the killed pod, on the same node
        wait_until("the replacement ready", lambda: again.ready() or again.process.poll() is not None)
        assert again.ready(), again.log()
        infer(again)
        report = again.fetch()
        assert report["hit"] and f"model storage s3://models/prod at {server.endpoint}" in str(report["store_error"])

        elsewhere = node_b.run(template, "lin-3")  # a node whose cache never held the model
        assert elsewhere.process.wait(timeout=120) == 3
        log = elsewhere.log()
        assert "model storage s3://models/prod at" in log and "'linear' is not cached on this node" in log
    finally:
        node_a.stop()
        node_b.stop()
