"""Measuring a model's profile on this machine with onnxruntime's CPU provider.

- **weights_bytes**: the bytes of the model's initializers as stored (``onnxgraph.weights_bytes``).
- **bytes_per_sample**: every intermediate tensor of the graph is captured at batch 1 and batch 2 and the
  graph is walked in execution order, holding each tensor from the node that makes it to its last consumer;
  the peak of that live set (inputs and outputs included) is measured at both batch sizes and the difference
  is what one more sample costs. onnxruntime aliases some outputs (``Reshape``) and fuses nodes, so this is an
  upper bound of its arena's growth, which is what a memory reservation needs.
- **latency and throughput vs batch size**: back-to-back calls of the fully (online-)optimised session, after
  a warm-up, for at least ``min_iterations`` calls and ``budget_s`` seconds per batch size.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from octacloud.toolchain.onnxgraph import open_session, run, session_options, weights_bytes
from octacloud.toolchain.profile import BatchMeasurement, ModelProfile, Precision
from octacloud.toolchain.spec import TensorSpec, make_samples


@dataclass(frozen=True, slots=True)
class ProfileSettings:
    threads: int = 2
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    """Measured up to the model's max batch size."""
    budget_s: float = 1.0
    """Wall time spent per batch size (at least ``min_iterations`` calls, at most ``max_iterations``)."""
    min_iterations: int = 3
    max_iterations: int = 200
    shape_hints: Mapping[str, int] | None = None
    """Sizes of dynamic non-batch axes (e.g. sequence length) per input name."""
    seed: int = 0


def _peak_live_bytes(model: onnx.ModelProto, sizes: Mapping[str, int]) -> int:
    graph = model.graph
    consumers_end: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        names = list(node.input)
        for attr in node.attribute:  # values a subgraph reads from the enclosing scope
            if attr.type == onnx.AttributeProto.GRAPH:
                names.extend(n for sub in attr.g.node for n in sub.input)
        for n in names:
            consumers_end[n] = i
    end = len(graph.node)
    for out in graph.output:
        consumers_end[out.name] = end
    dying: dict[int, list[str]] = {}
    for name, last in consumers_end.items():
        dying.setdefault(last, []).append(name)
    initializers = {i.name for i in graph.initializer}
    live = sum(sizes.get(v.name, 0) for v in graph.input if v.name not in initializers)
    peak = live
    for i, node in enumerate(graph.node):
        live += sum(sizes.get(o, 0) for o in node.output if o)
        peak = max(peak, live)
        live -= sum(sizes.get(n, 0) for n in dying.get(i, ()) if n not in initializers)
    return peak


def _probe(model: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    """A session of ``model`` that returns every intermediate tensor (unoptimised: each node's own output)."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    existing = {o.name for o in probe.graph.output}
    for node in probe.graph.node:
        for out in node.output:
            if out and out not in existing:
                probe.graph.output.append(onnx.ValueInfoProto(name=out))
                existing.add(out)
    return ort.InferenceSession(
        probe.SerializeToString(),
        session_options(threads, ort.GraphOptimizationLevel.ORT_DISABLE_ALL),
        providers=["CPUExecutionProvider"],
    )


def measure_bytes_per_sample(model: onnx.ModelProto, specs: Sequence[TensorSpec], settings: ProfileSettings) -> int:
    session = _probe(model, settings.threads)
    rng = np.random.default_rng(settings.seed)
    peaks = []
    for batch in (1, 2):
        inputs = make_samples(specs, batch, rng, settings.shape_hints)
        sizes = {name: int(a.nbytes) for name, a in inputs.items()}
        sizes.update({k: int(v.nbytes) for k, v in run(session, inputs).items()})
        peaks.append(_peak_live_bytes(model, sizes))
    slope = peaks[1] - peaks[0]
    return slope if slope > 0 else peaks[0]


def measure_latency(
    path: Path, specs: Sequence[TensorSpec], max_batch_size: int, settings: ProfileSettings
) -> tuple[BatchMeasurement, ...]:
    session = open_session(path, settings.threads)
    rng = np.random.default_rng(settings.seed)
    sizes = sorted({b for b in settings.batch_sizes if b <= max_batch_size} or {1})
    results = []
    for batch in sizes:
        inputs = make_samples(specs, batch, rng, settings.shape_hints)
        run(session, inputs)  # warm-up: allocations, kernel selection
        latencies: list[float] = []
        started = time.perf_counter()
        while len(latencies) < settings.max_iterations and (
            len(latencies) < settings.min_iterations or time.perf_counter() - started < settings.budget_s
        ):
            t0 = time.perf_counter()
            run(session, inputs)
            latencies.append(time.perf_counter() - t0)
        ms = np.asarray(latencies) * 1000.0
        p50, p99 = float(np.percentile(ms, 50)), float(np.percentile(ms, 99))
        results.append(
            BatchMeasurement(
                batch_size=batch,
                p50_ms=round(p50, 4),
                p99_ms=round(max(p99, p50), 4),
                samples_per_s=round(batch * 1000.0 / float(ms.mean()), 2),
                iterations=len(latencies),
            )
        )
    return tuple(results)


def measure_profile(
    name: str,
    precision: Precision,
    path: Path,
    specs: Sequence[TensorSpec],
    max_batch_size: int,
    settings: ProfileSettings,
) -> ModelProfile:
    """The profile of the ONNX model at ``path`` (version 1 as a placeholder until it is published)."""
    model = onnx.load(str(path))
    return ModelProfile(
        model=name,
        version=1,
        precision=precision,
        weights_bytes=weights_bytes(model),
        bytes_per_sample=measure_bytes_per_sample(model, specs, settings),
        sample_shapes={s.name: s.concrete_sample_shape(settings.shape_hints) for s in specs},
        max_batch_size=max_batch_size,
        threads=settings.threads,
        runtime=f"onnxruntime {ort.__version__}",
        measured_at=datetime.now(UTC).replace(microsecond=0).isoformat(),
        batches=measure_latency(path, specs, max_batch_size, settings),
    )
