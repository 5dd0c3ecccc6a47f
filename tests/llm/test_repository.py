"""SmolLM2 in the example repository: its config names the engine, sizing reads the GGUF's figures, and the
footprint counts the KV cache of every slot."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from octacloud.control.probes import RepositoryFootprints
from octacloud.control.sizing import GENERATIVE_QUEUE, inflight_per_replica, size_deployment
from octacloud.serving.generate.args import EngineArgs, ModelShape, is_generative
from octacloud.serving.repository.config import read_config
from octacloud.toolchain.gguf import read_gguf

pytestmark = pytest.mark.models

MODELS = Path(os.environ.get("OCTACLOUD_MODELS", Path(__file__).resolve().parents[2] / "models"))
SMOLLM2 = MODELS / "smollm2"


@pytest.fixture(scope="module")
def model() -> Path:
    if not (SMOLLM2 / "config.pbtxt").is_file():
        pytest.skip(f"smollm2 is not built in {MODELS}: run `make models`")
    return SMOLLM2


def test_the_published_config_names_the_engine_and_the_gguf_figures(model: Path) -> None:
    config = read_config(model)
    assert is_generative(config)
    shape = ModelShape.of(config)
    gguf = read_gguf(model / "1" / "model.gguf")
    assert shape.kv_elements_per_token == gguf.kv_elements_per_token == 30 * 3 * (64 + 64)  # layers × kv heads × K+V
    assert shape.context_max == gguf.context_max == 8192 and gguf.chat_template
    assert (model / "1" / "tokenizer.json").is_file()


def test_sizing_counts_the_kv_cache_of_every_slot(model: Path) -> None:
    footprint = RepositoryFootprints(MODELS)("smollm2")
    args = EngineArgs.read(model / "1")
    assert footprint.generative and footprint.max_batch == args.parallel == 8
    assert footprint.bytes_per_sample == 2048 * 23_040  # one sequence's f16 KV cache
    sizing = size_deployment(footprint, 1506, target_qps=None, min_replicas=1, max_replicas=1)
    assert "KV cache for 8 sequence(s) × 2048 tokens" in sizing.reason
    assert sizing.memory_mib * 8 <= sizing.octants * 1506
    assert inflight_per_replica(lambda: footprint) == 8 * GENERATIVE_QUEUE
    assert inflight_per_replica(lambda: RepositoryFootprints(MODELS)("mlp")) is None
