"""The committed device plugin stubs are what grpcio-tools generates from the vendored api.proto."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from octacloud.k8s.v1beta1 import api_pb2 as pb

SRC = Path(__file__).parents[2] / "src"
PACKAGE = Path("octacloud/k8s/v1beta1")


def test_stubs_match_the_proto(tmp_path: Path) -> None:
    protoc = pytest.importorskip("grpc_tools.protoc")
    (tmp_path / PACKAGE).mkdir(parents=True)
    shutil.copy(SRC / PACKAGE / "api.proto", tmp_path / PACKAGE / "api.proto")
    args = ["protoc", f"-I{tmp_path}", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}"]
    args += [f"--grpc_python_out={tmp_path}", str(tmp_path / PACKAGE / "api.proto")]
    assert protoc.main(args) == 0
    for name in ("api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py"):
        assert (tmp_path / PACKAGE / name).read_text() == (SRC / PACKAGE / name).read_text(), name


def test_wire_names_are_kubelets() -> None:
    services = {s.name: [m.name for m in s.methods] for s in pb.DESCRIPTOR.services_by_name.values()}
    assert services == {
        "Registration": ["Register"],
        "DevicePlugin": [
            "GetDevicePluginOptions",
            "ListAndWatch",
            "GetPreferredAllocation",
            "Allocate",
            "PreStartContainer",
        ],
    }
    assert pb.DESCRIPTOR.package == "v1beta1"  # method paths /v1beta1.Registration/Register ... as kubelet calls
    fields = {f.name: f.number for f in pb.ContainerAllocateResponse.DESCRIPTOR.fields}
    assert fields == {"envs": 1, "mounts": 2, "devices": 3, "annotations": 4, "cdi_devices": 5}
