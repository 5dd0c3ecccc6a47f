"""Triton's metric names on the metrics port, from a per-server registry."""

from __future__ import annotations

import urllib.request

import numpy as np
import tritonclient.http as httpclient

from octacloud.observability.serving import (
    COMPUTE_INFER_DURATION,
    COMPUTE_INPUT_DURATION,
    COMPUTE_OUTPUT_DURATION,
    EXEC_COUNT,
    INFERENCE_COUNT,
    PENDING_REQUESTS,
    QUEUE_DURATION,
    REQUEST_DURATION,
    REQUEST_FAILURE,
    REQUEST_SUCCESS,
)
from tests.protocols.conftest import ThreadedServer


def scrape(server: ThreadedServer) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_triton_metric_names_with_model_and_version_labels(server: ThreadedServer) -> None:
    c = httpclient.InferenceServerClient(server.http)
    try:
        before = scrape(server)
        x = np.ones((3, 4), np.float32)
        inputs = []
        for name in ("INPUT0", "INPUT1"):
            i = httpclient.InferInput(name, [3, 4], "FP32")
            i.set_data_from_numpy(x)
            inputs.append(i)
        c.infer("add", inputs, model_version="1")
        bad = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        bad.set_data_from_numpy(x[:1])
        try:
            c.infer("add", [bad], model_version="1")
        except Exception:
            pass
    finally:
        c.close()
    after = scrape(server)
    labels = '{model="add",version="1"}'
    for name in (
        REQUEST_SUCCESS,
        REQUEST_FAILURE,
        INFERENCE_COUNT,
        EXEC_COUNT,
        REQUEST_DURATION,
        QUEUE_DURATION,
        COMPUTE_INPUT_DURATION,
        COMPUTE_INFER_DURATION,
        COMPUTE_OUTPUT_DURATION,
        PENDING_REQUESTS,
    ):
        assert name + labels in after, name
    assert after[REQUEST_SUCCESS + labels] == before.get(REQUEST_SUCCESS + labels, 0) + 1
    assert after[REQUEST_FAILURE + labels] == before.get(REQUEST_FAILURE + labels, 0) + 1
    assert after[INFERENCE_COUNT + labels] == before.get(INFERENCE_COUNT + labels, 0) + 3
    assert after[COMPUTE_INFER_DURATION + labels] > 0
    assert '{model="add",version="2"}' in "".join(after)
