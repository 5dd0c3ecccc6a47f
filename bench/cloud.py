"""Gateway overhead: load through the octacloud gateway vs directly to the replica, in one run.

    .venv/bin/python bench/cloud.py [--model-dir DIR] [--seconds 3] [--concurrency 1 8] [--layout all]

Starts ``octacloud up`` on a temporary state dir with a one-node CPU fleet, deploys the model (default: the
seeded MLP 256→1024→1024→10, dynamic batching 2 ms, max batch 32; without the ``onnx`` package the MLP of
``$OCTACLOUD_MODELS``) on a whole CPU card, then measures at each concurrency against the replica's own
endpoint and against the gateway, interleaved point by point, and prints throughput, p50/p99, the
gateway/direct ratio, the 1-minute load average and the CPU each process spent per inference
(``/proc/PID/stat`` over the point ÷ the inferences the replica counted).

Clients: HTTP is Triton's perf_analyzer (binary tensors, ``-H "Authorization: Bearer <key>"``). perf_analyzer
2.51 sends ``-H`` headers over HTTP only, so gRPC is driven by a closed loop in its own process, for the direct
and the gateway rows alike: ``bench/openloop.py``'s raw HTTP/2 client (requests encoded once, ``authorization``
metadata; the default) or, with ``--grpc-client loadgen``, ``bench/loadgen.py`` (``grpc.aio``, which costs the
core it shares with the replica several times as much per call).

Two CPU layouts, both measured by default (``--layout``):

* ``shared``: every process (client, gateway, replica) may run on every core. On a small machine this
  measures CPU contention as much as the gateway: each request through the gateway costs the gateway's CPU,
  taken from the replica and the load generator.
* ``split`` (needs ≥ 2 cores): the gateway process on core 0, the replica and the client on the other
  cores, in both the direct and the gateway run — as in production, where the gateway does not share the
  replica's cores. This measures what the gateway itself limits: its added latency and throughput cap.
  On a 2-core machine the client shares the replica's one core, and that changes how the replica batches:
  in the direct rows client and replica take turns on the core, so a closed loop's requests reach the replica
  together; through a gateway on the other core they arrive one by one, and the replica (dispatch once more
  than 3 wait) forms about half the batch.
* ``apart`` (needs ≥ 2 cores; with ``--layout all``): the replica alone on the cores other than core 0, the
  client on core 0 in both rows, and in the gateway rows the gateway on core 0 too. The replica has its cores
  to itself in both rows, as on a machine with cores to spare, and the gateway is handicapped rather than
  helped: it competes with the client for core 0, where ``split`` gives it a core of its own.

The gateway's load shedding is off (``--limit max_inflight_per_replica=0``): its default bound, 8 requests in
flight per replica, is what a closed loop of 8 clients keeps in flight, so it would refuse requests that the
direct rows serve. The gateway requires an API key: the bench reads the admin key ``octacloud up`` wrote to
``<state-dir>/admin.key``. The replica serves only its cloud's callers: the direct rows send the cloud's
internal secret (``<state-dir>/internal.secret``) as ``x-octacloud-internal``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from benchutil import LocalCloud, cpu_s, find_replica_pid, syscalls
from octacloud.security.internal_auth import HEADER
from record import Recorder, add_flag

ROOT = Path(__file__).resolve().parent.parent


CONFIG = """name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 32
input [ {{ name: "{i}" data_type: TYPE_FP32 dims: [ {dim} ] }} ]
output [ {{ name: "{o}" data_type: TYPE_FP32 dims: [ 10 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 2000 }}
"""


def build_mlp(repo: Path, name: str = "mlp") -> None:
    """The seeded MLP; without the onnx package, a copy of ``$OCTACLOUD_MODELS/mlp`` with the same batching."""
    try:
        import onnx
    except ImportError:
        shipped = Path(os.environ.get("OCTACLOUD_MODELS", "models")) / "mlp" / "1" / "model.onnx"
        if not shipped.exists():
            raise SystemExit("building the MLP needs onnx (pip install onnx), or pass --model-dir") from None
        print(f"(onnx is not installed: using {shipped})")
        (repo / name / "1").mkdir(parents=True)
        shutil.copy(shipped, repo / name / "1" / "model.onnx")
        i, dims, o = io_of(repo / name / "1" / "model.onnx")
        (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name, i=i, o=o, dim=dims[0]))
        return
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(42)
    sizes = [256, 1024, 1024, 10]
    nodes, inits, prev = [], [], "INPUT0"
    for k in range(3):
        w = (rng.standard_normal((sizes[k], sizes[k + 1])) / np.sqrt(sizes[k])).astype(np.float32)
        inits += [
            numpy_helper.from_array(w, f"W{k}"),
            numpy_helper.from_array(np.zeros(sizes[k + 1], np.float32), f"B{k}"),
        ]
        out = "OUTPUT0" if k == 2 else f"H{k}"
        nodes += [helper.make_node("MatMul", [prev, f"W{k}"], [f"M{k}"])]
        if k < 2:
            nodes += [
                helper.make_node("Add", [f"M{k}", f"B{k}"], [f"A{k}"]),
                helper.make_node("Relu", [f"A{k}"], [out]),
            ]
        else:
            nodes += [helper.make_node("Add", [f"M{k}", f"B{k}"], [out])]
        prev = out
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", 256])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", 10])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (repo / name / "1").mkdir(parents=True)
    onnx.save(model, str(repo / name / "1" / "model.onnx"))
    (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name, i="INPUT0", o="OUTPUT0", dim=256))


def io_of(onnx_path: Path) -> tuple[str, list[int], str]:
    import onnxruntime as ort

    s = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    i, o = s.get_inputs()[0], s.get_outputs()[0]
    return i.name, [d if isinstance(d, int) else 1 for d in i.shape[1:]], o.name


def set_preferred_batch(config_file: Path, n: int) -> None:
    """Rewrite a model's config with ``dynamic_batching { preferred_batch_size: [n] }`` (its delay kept)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    if n < 1:
        raise SystemExit(f"--preferred-batch must be at least 1, got {n}")
    config = text_format.Parse(config_file.read_text(), mc.ModelConfig())
    if not config.HasField("dynamic_batching") or n > config.max_batch_size:
        raise SystemExit(f"{config_file}: --preferred-batch {n} needs dynamic batching and max_batch_size >= {n}")
    config.dynamic_batching.preferred_batch_size[:] = [n]
    config_file.write_text(text_format.MessageToString(config))


def batching_rule(config_file: Path) -> str:
    """The replica's effective batching rule, read back from the model's config."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    config = text_format.Parse(config_file.read_text(), mc.ModelConfig())
    if not config.HasField("dynamic_batching"):
        return "no dynamic batching"
    db = config.dynamic_batching
    delay = f"{db.max_queue_delay_microseconds} us"
    if db.preferred_batch_size:
        return f"a batch goes once {max(db.preferred_batch_size)} rows wait, or after {delay} (preferred_batch_size)"
    return f"a batch goes once more than 3 requests wait, or after {delay} (octacloud's default)"


def perf_analyzer_path() -> str:
    out = subprocess.run(
        ["bash", str(ROOT / "bench/peers/setup.sh"), "perf_analyzer"], check=True, capture_output=True, text=True
    ).stdout
    return out.strip().split(": ", 1)[1]


def run_pa(
    pa: str, model: str, target: str, concurrency: int, seconds: float, shape: str, header: str
) -> dict[str, float]:
    """perf_analyzer over HTTP (binary tensors), retried once if unstable."""
    with tempfile.NamedTemporaryFile(suffix=".csv", delete=False) as f:
        out = f.name
    argv = [
        pa, "-m", model, "-u", target, "-i", "http", "--shape", shape, "--input-data", "random",
        "--concurrency-range", str(concurrency), "-p", str(int(seconds * 1000)), "-s", "50", "-r", "6", "-f", out,
        "-H", header,
    ]  # fmt: skip
    for attempt in range(3):
        run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        if run.returncode == 0:
            break
        if attempt == 2:
            why = (run.stdout + run.stderr).strip().splitlines()[-3:]
            print(f"  (perf_analyzer failed on {target}: {why})", flush=True)
            return {"throughput": float("nan"), "p50_ms": float("nan"), "p99_ms": float("nan")}
        argv[argv.index("-s") + 1] = "100"  # a noisy machine: accept a wider spread rather than lose the point
    with open(out) as fh:
        row = next(csv.DictReader(fh))
    os.unlink(out)
    return {
        "throughput": float(row["Inferences/Second"]),
        "p50_ms": float(row["p50 latency"]) / 1000,
        "p99_ms": float(row["p99 latency"]) / 1000,
    }


def _pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of a process (new threads inherit from the one that starts them)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except OSError:  # a thread that just ended
            pass


def place(layout: str, gateway_pid: int, replica_pid: int, cores: int) -> None:
    """Apply a CPU layout to the gateway, the replica and this process (perf_analyzer inherits it)."""
    every = set(range(cores))
    gateway, replica, client = every, every, every
    if layout == "split":
        gateway, replica, client = {0}, every - {0}, every - {0}
    elif layout == "apart":
        gateway, replica, client = {0}, every - {0}, {0}
    _pin(gateway_pid, gateway)
    _pin(replica_pid, replica)
    os.sched_setaffinity(0, client)


def run_openloop(target: str, model: str, c: int, seconds: float, shape: str, header: str) -> dict[str, float]:
    """bench/openloop.py's gRPC client (raw HTTP/2, requests encoded once) as a closed loop of ``c`` calls with
    ``header`` as metadata, in its own process."""
    import openloop as ol

    name, _, value = header.partition(":")
    host, _, port = target.rpartition(":")
    load = ol.Target("grpc", host, int(port), ol.infer_message(model, shape), ((name.lower(), value),))
    res = ol.run_load(load, seconds=seconds, concurrency=c, procs=1, warmup_s=0.5).summary()
    if res["errors"] or res["refused_per_s"]:
        print(f"  (on {target}: errors {res['errors']}, refused {res['refused_per_s']}/s)", flush=True)
    return {"throughput": res["ok_per_s"], "p50_ms": res["p50_ms"], "p99_ms": res["p99_ms"]}


def run_loadgen(target: str, model: str, c: int, seconds: float, shape: str, header: str) -> dict[str, float]:
    """bench/loadgen.py (closed loop of ``c`` calls with ``header`` as metadata) in its own process."""
    name, _, value = header.partition(":")
    argv = [sys.executable, str(ROOT / "bench" / "loadgen.py"), target, model, shape, "--concurrency", str(c),
            "--seconds", str(seconds), "--metadata", f"{name.lower()}={value}"]  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        print(f"  (load generator failed on {target}: {run.stderr.strip().splitlines()[-1:]})", flush=True)
        return {"throughput": float("nan"), "p50_ms": float("nan"), "p99_ms": float("nan")}
    result: dict[str, float] = json.loads(run.stdout)
    return result


def inferences(http_port: int, model: str, secret: str) -> tuple[int, int]:
    """What the replica counted (asked directly, with the cloud's internal secret): inferences and executions
    (batches run), whose ratio over a point is the average batch the replica formed."""
    req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v2/models/{model}/stats", headers={HEADER: secret})
    with urllib.request.urlopen(req, timeout=10) as r:
        stats = json.loads(r.read())["model_stats"]
    return sum(int(s["inference_count"]) for s in stats), sum(int(s["execution_count"]) for s in stats)


def measure(
    protocol: str, target: str, c: int, args: argparse.Namespace, model: str, shape: str, header: str, pa: str,
    pids: dict[str, int], replica_http: int, secret: str, profile: Path | None = None,
) -> dict[str, Any]:  # fmt: skip
    spy = None
    if profile is not None:
        profile.parent.mkdir(parents=True, exist_ok=True)
        spy = subprocess.Popen(
            [shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"), "record", "--pid",
             str(pids["gateway"]), "--rate", "200", "--format", "raw", "--native", "--output", str(profile)],
            stdout=subprocess.DEVNULL, stderr=profile.with_suffix(".log").open("w"),
        )  # fmt: skip
    load = os.getloadavg()[0]
    cpu0 = {k: cpu_s(p) for k, p in pids.items()}
    io0 = {k: syscalls(p) for k, p in pids.items()}
    n0, e0 = inferences(replica_http, model, secret)
    if protocol == "http":
        res: dict[str, Any] = run_pa(pa, model, target, c, args.seconds, shape, header)
    elif args.grpc_client == "openloop":
        res = run_openloop(target, model, c, args.seconds, shape, header)
    else:
        res = run_loadgen(target, model, c, args.seconds, shape, header)
    n1, e1 = inferences(replica_http, model, secret)
    n = max(1, n1 - n0)
    if spy is not None:
        spy.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
        spy.wait(timeout=30)
    res["load"] = load
    res["batch"] = n / max(1, e1 - e0)
    for k, p in pids.items():
        res[f"{k}_us"] = (cpu_s(p) - cpu0[k]) / n * 1e6
        reads, writes = syscalls(p)
        res[f"{k}_io"] = ((reads - io0[k][0]) / n, (writes - io0[k][1]) / n)
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, help="A Triton-layout model folder to use instead of the MLP.")
    parser.add_argument("--shape", help="the model's input as NAME:DIMS (default: read from the model).")
    parser.add_argument("--seconds", type=float, default=3.0, help="measurement window per point.")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument(
        "--layout",
        choices=["shared", "split", "apart", "both", "all"],
        default="both",
        help="CPU layouts to run (both: shared and split; all: the three)",
    )
    parser.add_argument("--protocols", nargs="+", default=["http", "grpc"], choices=["http", "grpc"])
    parser.add_argument(
        "--grpc-client",
        choices=["openloop", "loadgen"],
        default="openloop",
        help="the gRPC load: bench/openloop.py's raw HTTP/2 client (default; 30-50 us of CPU per call, as "
        "perf_analyzer is over HTTP) or bench/loadgen.py (grpc.aio, several times that, on the replica's cores)",
    )
    parser.add_argument(
        "--preferred-batch",
        type=int,
        metavar="N",
        help="set the model's preferred_batch_size to [N] (Triton's option: a batch goes once N requests wait, "
        "else after the queue delay), for both rows alike. With N = the concurrency the replica forms whole "
        "batches however the requests' arrivals are spread, so the rows differ by the gateway alone.",
    )
    parser.add_argument(
        "--py-spy",
        type=Path,
        metavar="DIR",
        help="also sample the gateway with py-spy during each gateway point (raw stacks in DIR; the sampling "
        "costs the gateway CPU, so read its figures from a run without it)",
    )
    add_flag(parser)
    args = parser.parse_args()
    recorder = Recorder("cloud")

    pa = perf_analyzer_path()
    work = Path(tempfile.mkdtemp(prefix="octacloud-bench-models-"))
    repo = work / "models"
    if args.model_dir:
        repo.mkdir()
        shutil.copytree(args.model_dir, repo / args.model_dir.name)
        model = args.model_dir.name
    else:
        build_mlp(repo)
        model = "mlp"
    if args.preferred_batch is not None:
        set_preferred_batch(repo / model / "config.pbtxt", args.preferred_batch)
    if args.shape is None:
        onnx_file = next((repo / model).glob("*/model.onnx"))
        name, dims, _ = io_of(onnx_file)
        args.shape = f"{name}:{','.join(map(str, dims))}"
    cores = os.cpu_count() or 1
    cloud = LocalCloud(repo, prefix="octacloud-bench-cloud-", extra=["--limit", "max_inflight_per_replica=0"])
    try:
        cloud.start(60)
        key, http_port, grpc_port = cloud.key, cloud.http_port, cloud.grpc_port
        # a whole card on a one-card fleet: past the 80 % failover rule, which priority >= 100 may cross
        replica = cloud.deploy({"name": model, "model": model, "octants": 8, "priority": 100})
        print(f"replica {replica['id']} on {replica['node']} cards {replica['gpus']} ({cores} cores on this machine)")
        print(f"batching rule (both rows): {batching_rule(repo / model / 'config.pbtxt')}")
        layouts = {"both": ["shared", "split"], "all": ["shared", "split", "apart"]}.get(args.layout, [args.layout])
        if cores < 2 and layouts != ["shared"]:
            print("(split and apart layouts skipped: they need at least 2 cores)")
            layouts = ["shared"]
        secret = cloud.secret  # the replica serves only its cloud's callers
        replica_pid = find_replica_pid(int(replica["http_port"]))  # type: ignore[call-overload]
        rows = []
        pids = {"gateway": cloud.pid, "replica": replica_pid}
        replica_http = int(replica["http_port"])  # type: ignore[call-overload]
        for layout in layouts:
            place(layout, cloud.pid, replica_pid, cores)
            for protocol in args.protocols:
                direct = f"127.0.0.1:{replica['http_port' if protocol == 'http' else 'grpc_port']}"
                gateway = f"127.0.0.1:{http_port if protocol == 'http' else grpc_port}"
                for i, c in enumerate(args.concurrency):
                    res = {}
                    order = ("direct", "gateway") if i % 2 == 0 else ("gateway", "direct")
                    for where in order:  # interleaved, the order alternating, so that load drift hits both
                        target = direct if where == "direct" else gateway
                        header = f"{HEADER}:{secret}" if where == "direct" else f"Authorization:Bearer {key}"
                        profile = None
                        if args.py_spy is not None and where == "gateway":
                            profile = args.py_spy / f"{layout}-{protocol}-c{c}.txt"
                        res[where] = measure(
                            protocol,
                            target,
                            c,
                            args,
                            model,
                            args.shape,
                            header,
                            pa,
                            pids,
                            replica_http,
                            secret,
                            profile,
                        )
                        r = res[where]
                        print(
                            f"  {layout:6} {protocol:4} c={c} {where:7}: {r['throughput']:7.0f} infer/s  "
                            f"p50 {r['p50_ms']:6.2f}  p99 {r['p99_ms']:6.2f} ms  gateway {r['gateway_us']:4.0f} "
                            f"replica {r['replica_us']:4.0f} us/inf  batch {r['batch']:4.1f}  load {r['load']:4.1f}  "
                            f"reads/writes per inf: gateway {r['gateway_io'][0]:.2f}/{r['gateway_io'][1]:.2f} "
                            f"replica {r['replica_io'][0]:.2f}/{r['replica_io'][1]:.2f}",
                            flush=True,
                        )
                    rows.append((layout, protocol, c, res["direct"], res["gateway"]))
            place("shared", cloud.pid, replica_pid, cores)
        print(f"\nload now {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print(f"{'layout':6} {'protocol':8} {'conc':>4}  {'direct inf/s':>12} {'p50':>7} {'p99':>7}  "
              f"{'gateway inf/s':>13} {'p50':>7} {'p99':>7}  {'gw/direct':>9}  {'gw cpu us/inf':>13}  "
              f"{'batch d/gw':>10}")  # fmt: skip
        for layout, protocol, c, d_res, g_res in rows:
            print(
                f"{layout:6} {protocol:8} {c:>4}  {d_res['throughput']:>12.1f} {d_res['p50_ms']:>7.2f} "
                f"{d_res['p99_ms']:>7.2f}  {g_res['throughput']:>13.1f} {g_res['p50_ms']:>7.2f} "
                f"{g_res['p99_ms']:>7.2f}  {g_res['throughput'] / d_res['throughput']:>9.3f}  "
                f"{g_res['gateway_us']:>13.0f}  {d_res['batch']:>4.1f}/{g_res['batch']:<4.1f}"
            )
        print("\n(latencies in ms; gw/direct is the gateway's throughput as a share of the direct replica's;")
        print(" gw cpu: the gateway process's CPU per inference through it;")
        print(" shared: all processes on all cores; split: gateway on core 0, replica and client on the rest;")
        print(" apart: replica alone on the cores but 0, client (and in its rows the gateway) on core 0;")
        print(f" HTTP: perf_analyzer; gRPC: {args.grpc_client} (bench/{args.grpc_client}.py), authorization metadata)")
        recorder.save([{"layout": lay, "protocol": pr, "concurrency": c, "direct": d, "gateway": g}
                       for lay, pr, c, d, g in rows])  # fmt: skip
    finally:
        cloud.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
