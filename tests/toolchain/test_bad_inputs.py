"""Bad inputs to ``convert`` fail with a message that says what was wrong, and leave the repository untouched."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import pytest
import torch

from octacloud.core.errors import InvalidSpecError, OctacloudError
from octacloud.toolchain.convert import ConvertOptions, convert
from octacloud.toolchain.errors import CalibrationError, ConversionError, SourceError
from octacloud.toolchain.repository import ModelRepository
from octacloud.toolchain.sources import SourceOptions, load_source
from octacloud.toolchain.spec import TensorSpec

from .conftest import MLP_INPUT, fast_options, snapshot

MLP_SOURCE = SourceOptions(inputs=(MLP_INPUT,), output_names=("logits",), classifier=True)


@pytest.fixture(scope="module")
def populated(mlp_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository that already serves ``tiny`` (all three variants): failures must not change a byte of it."""
    repo = tmp_path_factory.mktemp("populated")
    convert(load_source(mlp_file, MLP_SOURCE), ModelRepository(repo), fast_options("tiny"))
    return repo


def attempt(repo: Path, make: Callable[[], None], error: type[OctacloudError], message: str) -> None:
    before = snapshot(repo)
    with pytest.raises(error, match=message):
        make()
    assert snapshot(repo) == before
    assert not any(p.name.startswith(".") for p in repo.iterdir()), "a staging area was left behind"


def test_a_missing_source_file(populated: Path, tmp_path: Path) -> None:
    attempt(
        populated,
        lambda: convert(
            load_source(tmp_path / "nope.pt", MLP_SOURCE), ModelRepository(populated), fast_options("tiny")
        ),
        SourceError,
        r"nope.pt does not exist",
    )


def test_a_hugging_face_directory_without_weights(populated: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    attempt(populated, lambda: load_source(tmp_path), SourceError, r"has no weights .* pass --random-init")


def test_a_task_the_model_cannot_do(populated: Path, tmp_path: Path) -> None:
    import transformers

    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8], depths=[1], layer_type="basic")
    config.save_pretrained(tmp_path)
    attempt(
        populated,
        lambda: load_source(tmp_path / "config.json", SourceOptions(task="sentence-embedding")),
        SourceError,
        "a vision model .* converts for image-classification only",
    )


def test_a_state_dict_instead_of_a_module(populated: Path, tmp_path: Path, mlp_file: Path) -> None:
    weights = tmp_path / "weights.pt"
    torch.save(torch.load(mlp_file, weights_only=False).state_dict(), weights)
    attempt(populated, lambda: load_source(weights, MLP_SOURCE), SourceError, "holds a state_dict")


def test_a_module_without_its_input_signature(populated: Path, mlp_file: Path) -> None:
    attempt(populated, lambda: load_source(mlp_file), SourceError, r"pass --input NAME:DTYPE:SHAPE")


def test_an_input_signature_the_module_cannot_take(populated: Path, mlp_file: Path) -> None:
    wrong = SourceOptions(inputs=(TensorSpec("input", "float32", (None, 17)),))
    attempt(
        populated,
        lambda: convert(load_source(mlp_file, wrong), ModelRepository(populated), fast_options("tiny")),
        SourceError,
        r"forward\(\) failed on inputs",
    )


@torch.library.custom_op("octatest::frobnicate", mutates_args=())
def frobnicate(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@frobnicate.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class UsesACustomOp(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return frobnicate(x) + 1


def test_a_torch_operator_without_an_onnx_translation(populated: Path) -> None:
    from octacloud.toolchain.torchsource import TorchSource

    source = TorchSource(UsesACustomOp(), [MLP_INPUT], description="UsesACustomOp")
    attempt(
        populated,
        lambda: convert(source, ModelRepository(populated), fast_options("tiny")),
        ConversionError,
        r"operator 'octatest.frobnicate' has no ONNX translation",
    )


def test_an_onnx_operator_onnxruntime_cannot_run(populated: Path, tmp_path: Path) -> None:
    x = oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 4])
    y = oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 4])
    graph = oh.make_graph([oh.make_node("Frobnicate", ["x"], ["y"], domain="com.example")], "g", [x], [y])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("com.example", 1)])
    onnx.save(model, tmp_path / "custom.onnx")
    attempt(
        populated,
        lambda: load_source(tmp_path / "custom.onnx"),
        ConversionError,
        r"no implementation of operator 'com.example:Frobnicate",
    )


def test_a_file_that_is_not_onnx(populated: Path, tmp_path: Path) -> None:
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    attempt(populated, lambda: load_source(tmp_path / "junk.onnx"), ConversionError, "not a readable ONNX model")


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        (
            {"input": np.zeros((8, 15), np.float32)},
            r"'input' has shape \[8, 15\] but the model expects input: "
            r"float32\[N,16\]",
        ),
        ({"pixels": np.zeros((8, 16), np.float32)}, r"missing input\(s\) \['input'\]"),
        ({"input": np.zeros((8, 16), np.int32)}, "has dtype int32 but the model expects float32"),
    ],
)
def test_a_calibration_set_that_does_not_match_the_model(
    populated: Path, mlp_file: Path, tmp_path: Path, arrays: dict[str, np.ndarray], message: str
) -> None:
    cal = tmp_path / "cal.npz"
    np.savez(cal, **arrays)
    options = fast_options("tiny", calibration=cal)
    attempt(
        populated,
        lambda: convert(load_source(mlp_file, MLP_SOURCE), ModelRepository(populated), options),
        CalibrationError,
        message,
    )


def test_a_missing_or_unreadable_calibration_file(populated: Path, mlp_file: Path, tmp_path: Path) -> None:
    source = load_source(mlp_file, MLP_SOURCE)
    attempt(
        populated,
        lambda: convert(source, ModelRepository(populated), fast_options("tiny", calibration=tmp_path / "none.npz")),
        CalibrationError,
        "none.npz does not exist",
    )
    (tmp_path / "bad.npz").write_bytes(b"zip? no")
    attempt(
        populated,
        lambda: convert(source, ModelRepository(populated), fast_options("tiny", calibration=tmp_path / "bad.npz")),
        CalibrationError,
        "not a readable .npz file",
    )


def test_parity_samples_that_do_not_match_the_model(populated: Path, mlp_file: Path) -> None:
    options = fast_options("tiny", samples={"input": np.zeros((2, 3), np.float32)})
    attempt(
        populated,
        lambda: convert(load_source(mlp_file, MLP_SOURCE), ModelRepository(populated), options),
        SourceError,
        r"sample set .* has shape \[2, 3\]",
    )


def test_a_different_signature_under_an_existing_name_fails_before_the_variants_are_built(
    populated: Path, tmp_path: Path
) -> None:
    import torch

    torch.manual_seed(0)
    wider = torch.nn.Sequential(torch.nn.Linear(16, 5)).eval()  # 5 outputs where "tiny" has 4
    torch.save(wider, tmp_path / "wider.pt")
    messages: list[str] = []
    attempt(
        populated,
        lambda: convert(
            load_source(tmp_path / "wider.pt", MLP_SOURCE),
            ModelRepository(populated),
            fast_options("tiny"),
            progress=messages.append,
        ),
        InvalidSpecError,
        "already exists .* with different inputs, outputs or max_batch_size",
    )
    assert not any("building" in m for m in messages)


def test_bad_options_are_refused_before_any_work() -> None:
    with pytest.raises(OctacloudError, match="unknown precision"):
        ConvertOptions(name="m", precisions=("int4",))  # type: ignore[arg-type]
    with pytest.raises(OctacloudError, match="not usable as a repository directory"):
        ConvertOptions(name="../escape")
    with pytest.raises(OctacloudError, match="max_batch_size must be >= 1"):
        ConvertOptions(name="m", max_batch_size=0)
    with pytest.raises(OctacloudError, match="precisions repeat"):
        ConvertOptions(name="m", precisions=("int8", "int8"))
