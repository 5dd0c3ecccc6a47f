"""``convert`` end to end on tiny models: every source kind, the variants, parity, profiles and publishing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from octacloud.toolchain.convert import ConversionResult, convert
from octacloud.toolchain.parity import DEFAULT_TOLERANCES
from octacloud.toolchain.profile import read_profile
from octacloud.toolchain.repository import ModelRepository
from octacloud.toolchain.sources import SourceOptions, load_source

from .conftest import MLP_INPUT, fast_options

MLP_SOURCE = SourceOptions(inputs=(MLP_INPUT,), output_names=("logits",), classifier=True)


def run(path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return np.asarray(ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0])


@pytest.fixture(scope="module")
def converted(mlp_file: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[ConversionResult, Path]:
    repo = tmp_path_factory.mktemp("repo")
    result = convert(load_source(mlp_file, MLP_SOURCE), ModelRepository(repo), fast_options("tiny"))
    return result, repo


def test_publishes_three_variants_as_separate_versioned_models(converted: tuple[ConversionResult, Path]) -> None:
    result, repo = converted
    assert [v.name for v in result.published] == ["tiny", "tiny_fp16", "tiny_int8"]
    assert not result.rejected
    assert sorted(p.name for p in repo.iterdir()) == ["tiny", "tiny_fp16", "tiny_int8"]  # no staging left
    for v in result.variants:
        version_dir = repo / v.name / "1"
        names = sorted(p.name for p in version_dir.iterdir())
        assert names == ["model.onnx", "octacloud-manifest.json", "parity.json", "profile.json"]
        assert json.loads((version_dir / "parity.json").read_text())["passed"] is True


def test_the_config_carries_io_batching_and_the_measured_sizes(converted: tuple[ConversionResult, Path]) -> None:
    _, repo = converted
    for name, precision in (("tiny", "fp32"), ("tiny_fp16", "fp16"), ("tiny_int8", "int8")):
        config = text_format.Parse((repo / name / "config.pbtxt").read_text(), mc.ModelConfig())
        profile = read_profile(repo / name / "1")
        assert config.name == name and config.max_batch_size == 8
        assert [(i.name, list(i.dims), i.data_type) for i in config.input] == [("input", [16], mc.TYPE_FP32)]
        assert [(o.name, list(o.dims), o.data_type) for o in config.output] == [("logits", [4], mc.TYPE_FP32)]
        assert config.dynamic_batching.max_queue_delay_microseconds == 2000
        assert config.parameters["octacloud.weights_bytes"].string_value == str(profile.weights_bytes)
        assert config.parameters["octacloud.bytes_per_sample"].string_value == str(profile.bytes_per_sample)
        assert profile.model == name and profile.precision == precision and profile.version == 1
        assert [b.batch_size for b in profile.batches] == [1, 4]
    fp32, fp16 = read_profile(repo / "tiny" / "1"), read_profile(repo / "tiny_fp16" / "1")
    assert fp32.weights_bytes == (16 * 32 + 32 + 32 * 4 + 4) * 4  # the MLP's parameters, in fp32
    assert fp16.weights_bytes == fp32.weights_bytes // 2
    # Peak live tensors per sample: the 16-float input, then the 32-float hidden layer beside the 4 logits ...
    assert fp32.bytes_per_sample == (32 + 32) * 4  # Gemm's output (32) and the ReLU's (32) are live together


def test_the_fp32_graph_computes_what_torch_computes_at_any_batch(
    mlp_file: Path, converted: tuple[ConversionResult, Path]
) -> None:
    _, repo = converted
    module = torch.load(mlp_file, weights_only=False)
    for batch in (1, 3, 8):
        x = np.random.default_rng(batch).standard_normal((batch, 16)).astype(np.float32)
        expected = module(torch.from_numpy(x)).detach().numpy()
        np.testing.assert_allclose(run(repo / "tiny" / "1" / "model.onnx", {"input": x}), expected, atol=1e-5)
        np.testing.assert_allclose(run(repo / "tiny_fp16" / "1" / "model.onnx", {"input": x}), expected, atol=5e-3)


def test_republishing_adds_version_two_only_for_the_converted_variants(
    mlp_file: Path, converted: tuple[ConversionResult, Path]
) -> None:
    _, repo = converted
    result = convert(load_source(mlp_file, MLP_SOURCE), ModelRepository(repo), fast_options(precisions=("fp32",)))
    assert [(v.name, v.published.version if v.published else None) for v in result.variants] == [("tiny", 2)]
    assert sorted(p.name for p in (repo / "tiny").iterdir()) == ["1", "2", "config.pbtxt"]
    assert sorted(p.name for p in (repo / "tiny_fp16").iterdir()) == ["1", "config.pbtxt"]


def test_torchscript_and_onnx_sources(mlp_file: Path, tmp_path: Path, converted: tuple[ConversionResult, Path]) -> None:
    module = torch.load(mlp_file, weights_only=False)
    scripted = tmp_path / "mlp_script.pt"
    torch.jit.script(module).save(str(scripted))
    repo = ModelRepository(tmp_path / "repo")
    ts = convert(load_source(scripted, MLP_SOURCE), repo, fast_options("ts", precisions=("fp32",)))
    assert ts.variants[0].parity.passed and ts.source.startswith("TorchScript")
    onnx_source = load_source(converted[1] / "tiny" / "1" / "model.onnx")
    assert onnx_source.reference_name.startswith("onnxruntime")
    from_onnx = convert(onnx_source, repo, fast_options("from_onnx", precisions=("fp32", "int8")))
    assert [v.name for v in from_onnx.published] == ["from_onnx", "from_onnx_int8"]
    x = np.ones((2, 16), np.float32)
    np.testing.assert_allclose(
        run(tmp_path / "repo" / "from_onnx" / "1" / "model.onnx", {"input": x}),
        module(torch.from_numpy(x)).detach().numpy(),
        atol=1e-5,
    )


def test_static_int8_with_a_calibration_set(mlp_file: Path, tmp_path: Path) -> None:
    cal = tmp_path / "cal.npz"
    np.savez(cal, input=np.random.default_rng(1).standard_normal((16, 16)).astype(np.float32))
    result = convert(
        load_source(mlp_file, MLP_SOURCE),
        ModelRepository(tmp_path / "repo"),
        fast_options(precisions=("int8",), calibration=cal),
    )
    [variant] = result.published
    graph = onnx.load(str(variant.published.path / "model.onnx")) if variant.published else None
    assert graph is not None and {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in graph.graph.node}
    assert variant.parity.passed


def int8_weight_range(path: Path) -> tuple[int, int]:
    """The smallest and largest stored int8 weight of a quantized graph."""
    values = [
        onnx.numpy_helper.to_array(t)
        for t in onnx.load(str(path)).graph.initializer
        if t.data_type == onnx.TensorProto.INT8 and len(t.dims) >= 2
    ]
    assert values, f"{path} holds no int8 weights"
    return min(int(v.min()) for v in values), max(int(v.max()) for v in values)


def test_int8_weights_use_seven_bits_so_results_do_not_depend_on_vnni(
    converted: tuple[ConversionResult, Path], mlp_file: Path, tmp_path: Path
) -> None:
    # Full-range int8 weights overflow the int16 pair sums of x86 CPUs without VNNI (variants.py); 7-bit ones
    # cannot. Both the dynamic and the static (calibrated) path must keep weights within [-64, 64].
    _, repo = converted
    lo, hi = int8_weight_range(repo / "tiny_int8" / "1" / "model.onnx")
    assert lo >= -64 and hi <= 64 and max(-lo, hi) >= 60, (lo, hi)
    cal = tmp_path / "cal.npz"
    np.savez(cal, input=np.random.default_rng(1).standard_normal((16, 16)).astype(np.float32))
    static = convert(
        load_source(mlp_file, MLP_SOURCE),
        ModelRepository(tmp_path / "repo"),
        fast_options(precisions=("int8",), calibration=cal),
    )
    lo, hi = int8_weight_range(tmp_path / "repo" / "tiny_int8" / "1" / "model.onnx")
    assert static.published and lo >= -64 and hi <= 64 and max(-lo, hi) >= 60, (lo, hi)


def test_a_variant_outside_tolerance_is_not_published_unless_forced(mlp_file: Path, tmp_path: Path) -> None:
    impossible = dict(DEFAULT_TOLERANCES) | {"int8": DEFAULT_TOLERANCES["fp32"]}
    source = load_source(mlp_file, MLP_SOURCE)
    repo = ModelRepository(tmp_path)
    result = convert(source, repo, fast_options(tolerances=impossible))
    assert [v.name for v in result.rejected] == ["tiny_int8"]
    assert result.rejected[0].profile is None and result.rejected[0].parity.failures
    assert repo.models() == ["tiny", "tiny_fp16"]
    forced = convert(source, repo, fast_options(precisions=("int8",), tolerances=impossible, force=True))
    assert [v.name for v in forced.published] == ["tiny_int8"]
    stored = json.loads((tmp_path / "tiny_int8" / "1" / "parity.json").read_text())
    assert stored["forced"] is True and stored["passed"] is False and stored["failures"]


def _tiny_bert_dir(root: Path, sentence_transformers: bool) -> Path:
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=64,
    )
    transformers.BertModel(config).save_pretrained(root)
    if sentence_transformers:
        (root / "modules.json").write_text(
            json.dumps(
                [
                    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
                ]
            )
        )
        (root / "1_Pooling").mkdir()
        (root / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    return root


def test_a_sentence_transformers_directory_exports_pooling_and_normalisation(tmp_path: Path) -> None:
    source = load_source(_tiny_bert_dir(tmp_path / "st", sentence_transformers=True))
    assert [s.name for s in source.inputs] == ["input_ids", "attention_mask", "token_type_ids"]
    result = convert(source, ModelRepository(tmp_path / "repo"), fast_options("st", precisions=("fp32", "fp16")))
    assert all(v.parity.passed for v in result.variants)
    model = tmp_path / "repo" / "st" / "1" / "model.onnx"
    ids = np.array([[1, 5, 7, 9, 0, 0], [1, 2, 3, 4, 5, 6]], np.int64)  # sequence length differs from export's
    mask = (ids > 0).astype(np.int64)
    emb = run(model, {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)})
    assert emb.shape == (2, 32)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    # padding is ignored by the mean: the padded sentence embeds as its unpadded self
    short = run(
        model, {"input_ids": ids[:1, :4], "attention_mask": mask[:1, :4], "token_type_ids": np.zeros((1, 4), np.int64)}
    )
    np.testing.assert_allclose(emb[:1], short, atol=1e-5)


def test_an_architecture_built_from_its_config_with_seeded_weights(tmp_path: Path) -> None:
    import transformers

    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")
    config.num_labels = 5
    config.architectures = ["ResNetForImageClassification"]
    config.save_pretrained(tmp_path / "cfg")
    source = load_source(tmp_path / "cfg" / "config.json", SourceOptions(seed=3))
    assert source.classifier and source.inputs[0].shape == (None, 3, 224, 224)
    result = convert(source, ModelRepository(tmp_path / "repo"), fast_options("rn", precisions=("fp32",)))
    assert result.variants[0].parity.passed and result.variants[0].parity.outputs[0].top1_agreement == 1.0
    again = load_source(tmp_path / "cfg" / "config.json", SourceOptions(seed=3))
    x = {"pixel_values": np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)}
    np.testing.assert_array_equal(source.reference(x)["logits"], again.reference(x)["logits"])  # deterministic


def test_a_plain_encoder_exports_its_hidden_states_and_a_head_can_be_asked_for(tmp_path: Path) -> None:
    directory = _tiny_bert_dir(tmp_path / "bert", sentence_transformers=False)
    features = load_source(directory)
    assert not features.classifier
    result = convert(features, ModelRepository(tmp_path / "repo"), fast_options("feat", precisions=("fp32",)))
    assert result.variants[0].parity.passed
    config = text_format.Parse((tmp_path / "repo" / "feat" / "config.pbtxt").read_text(), mc.ModelConfig())
    assert [(o.name, list(o.dims)) for o in config.output] == [("last_hidden_state", [-1, 32])]
    classify = SourceOptions(task="text-classification", seed=1)
    head, again = load_source(directory, classify), load_source(directory, classify)
    assert head.classifier
    x = head.sample_inputs(2, np.random.default_rng(0))
    np.testing.assert_array_equal(head.reference(x)["logits"], again.reference(x)["logits"])  # seeded head


def _fixed_batch_onnx(path: Path, reshape: bool) -> Path:
    """x [1,4] @ W [4,3] → y [1,3] (exported without a dynamic batch axis); optionally a Reshape to [1,3]."""
    import onnx.helper as oh
    from onnx import numpy_helper

    vi = oh.make_tensor_value_info
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3) / 10, "w")
    shape = numpy_helper.from_array(np.array([1, 3], dtype=np.int64), "shape")
    nodes = [oh.make_node("MatMul", ["x", "w"], ["h" if reshape else "y"])]
    if reshape:
        nodes.append(oh.make_node("Reshape", ["h", "shape"], ["y"]))
    graph = oh.make_graph(
        nodes,
        "fixed",
        [vi("x", onnx.TensorProto.FLOAT, [1, 4])],
        [vi("y", onnx.TensorProto.FLOAT, [1, 3])],
        initializer=[w, shape],
    )
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]), path)
    return path


def test_an_onnx_file_with_a_fixed_batch_is_published_with_a_dynamic_one(tmp_path: Path) -> None:
    source = load_source(_fixed_batch_onnx(tmp_path / "fixed.onnx", reshape=False))
    result = convert(source, ModelRepository(tmp_path / "repo"), fast_options("fixed", precisions=("fp32",)))
    assert result.variants[0].parity.passed
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    got = run(tmp_path / "repo" / "fixed" / "1" / "model.onnx", {"x": x})
    np.testing.assert_allclose(got, x @ (np.arange(12, dtype=np.float32).reshape(4, 3) / 10), rtol=1e-5)


def test_a_graph_that_hard_codes_its_batch_size_is_refused_clearly(tmp_path: Path) -> None:
    from octacloud.toolchain.errors import ConversionError

    source = load_source(_fixed_batch_onnx(tmp_path / "reshaped.onnx", reshape=True))
    with pytest.raises(ConversionError, match="re-export it with a dynamic batch axis"):
        convert(source, ModelRepository(tmp_path / "repo"), fast_options("reshaped", precisions=("fp32",)))
    assert not (tmp_path / "repo").exists()
