"""The openb trace readers: both column sets, GPU specs, and errors that name file, line, column and value."""

from __future__ import annotations

from pathlib import Path

import pytest

from octacloud.core import InvalidSpecError
from octacloud.sim.traces import (
    GPU_MEMORY_MIB,
    TraceFormatError,
    TracePod,
    read_gpu_memory_table,
    read_nodes,
    read_pods,
)

from ..traces import require_traces

FULL_HEADER = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time"
)


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_nodes_get_cards_with_memory_from_the_table(tmp_path: Path) -> None:
    path = _write(tmp_path, "nodes.csv", "sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,2,P100\nn1,96000,1,0,\n")
    n0, n1 = read_nodes(path)
    assert (n0.name, n0.cpu_milli, n0.memory_mib, n0.gpu_count, n0.gpu_model) == ("n0", 64000, 262144, 2, "P100")
    assert [g.memory_mib for g in n0.gpus] == [16 * 1024, 16 * 1024]
    assert n1.gpu_count == 0
    assert GPU_MEMORY_MIB["V100M32"] == 32 * 1024


def test_full_and_short_pod_column_sets(tmp_path: Path) -> None:
    full = _write(
        tmp_path,
        "full.csv",
        f"{FULL_HEADER}\np0,6000,12288,1,460,T4|P100,LS,Running,10,200,10\np1,8000,1,0,0,,BE,Failed,,,\n",
    )
    short = _write(tmp_path, "short.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,88000,1,8,1000\n")
    p0, p1 = read_pods(full)
    assert p0 == TracePod(p0.request, 10, 200)
    assert p0.request.gpu_models == frozenset({"T4", "P100"})
    assert (p0.request.num_gpu, p0.request.gpu_milli, p0.request.is_sharing) == (1, 460, True)
    assert p1.request.num_gpu == 0 and p1.creation_time is None and p1.deletion_time is None
    (s0,) = read_pods(short)
    assert (s0.request.num_gpu, s0.request.total_gpu_milli, s0.creation_time) == (8, 8000, None)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,12x,1,1,1000\n", r"line 2, column 'cpu_milli'.*'12x'"),
        ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1,1,1,-5\n", r"line 2, column 'gpu_milli'.*-5"),
        ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1,1,2,500\n", r"line 2.*must take whole cards"),
        ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1,1,1,1000\np0,1,1,1,1000\n", "already defined on line 2"),
        ("name,cpu_milli,memory_mib,num_gpu\np0,1,1,1\n", r"missing column\(s\) \['gpu_milli'\]"),
        ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1,1\n", "line 2: expected 5 values"),
        ("", "the file is empty"),
    ],
)
def test_malformed_pod_rows_name_file_line_column_value(tmp_path: Path, text: str, message: str) -> None:
    path = _write(tmp_path, "pods.csv", text)
    with pytest.raises(TraceFormatError, match=message) as info:
        read_pods(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, InvalidSpecError)


def test_any_gpu_model_with_memory_from_a_column_or_a_table(tmp_path: Path) -> None:
    path = _write(tmp_path, "nodes.csv", "sn,cpu_milli,memory_mib,gpu,model\nn0,1,1,4,GPU-series-1\nn1,1,1,0,\n")
    with pytest.raises(TraceFormatError, match=r"line 2, column 'model'.*no card memory for GPU model 'GPU-series-1'"):
        read_nodes(path)
    node, cpu_only = read_nodes(path, gpu_memory={"GPU-series-1": 81920})
    assert node.gpus[3].memory_mib == 81920 and node.gpu_model == "GPU-series-1" and cpu_only.gpu_count == 0
    table = _write(tmp_path, "mem.csv", "model,gpu_memory_mib\nGPU-series-1,65536\n")
    (node, _) = read_nodes(path, gpu_memory=read_gpu_memory_table(table))
    assert node.gpus[0].memory_mib == 65536
    assert read_gpu_memory_table(table)["T4"] == GPU_MEMORY_MIB["T4"]  # merged over the built-in table
    column = _write(
        tmp_path,
        "col.csv",
        "sn,cpu_milli,memory_mib,gpu,model,gpu_memory_mib\nn0,1,1,8,GPU-series-1,49152\nn1,1,1,2,T4,\n",
    )
    a, b = read_nodes(column)
    assert a.gpus[7].memory_mib == 49152 and b.gpus[0].memory_mib == GPU_MEMORY_MIB["T4"]
    (h800,) = read_nodes(_write(tmp_path, "h.csv", "sn,cpu_milli,memory_mib,gpu,model\nn0,1,1,8,H800\n"))
    assert h800.gpus[0].memory_mib == 81920
    bad = _write(tmp_path, "bad.csv", "sn,cpu_milli,memory_mib,gpu,model,gpu_memory_mib\nn0,1,1,8,X,lots\n")
    with pytest.raises(TraceFormatError, match=r"line 2, column 'gpu_memory_mib'.*'lots'"):
        read_nodes(bad)
    dup = _write(tmp_path, "dup.csv", "model,gpu_memory_mib\nX,1\nX,2\n")
    with pytest.raises(TraceFormatError, match="already given on line 2"):
        read_gpu_memory_table(dup)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="cannot read the trace file"):
        read_pods(tmp_path / "absent.csv")


@pytest.mark.traces
def test_real_openb_files_parse() -> None:
    folder = require_traces()
    nodes = read_nodes(folder / "openb_node_list_gpu_node.csv")
    assert len(nodes) == 1213
    assert sum(n.gpu_count for n in nodes) == 6212
    pods = read_pods(folder / "openb_pod_list_default.csv")
    assert len(pods) == 8152
    assert sum(1 for p in pods if p.request.is_sharing) == 3078
    assert sum(1 for p in pods if p.request.num_gpu == 0) == 1088
    assert len(read_pods(folder / "openb_pod_list_multigpu30.csv")) > 8152
