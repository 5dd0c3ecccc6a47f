"""Source models: what ``octacloud convert`` starts from.

- a **Hugging Face** model directory (``config.json`` + ``model.safetensors``/``pytorch_model.bin``), a
  sentence-transformers directory (adds pooling and normalisation), or a bare ``config.json`` whose
  architecture is built with seeded weights (:mod:`octacloud.toolchain.huggingface`);
- a **PyTorch** file: TorchScript (``torch.jit.save``) or a whole module (``torch.save(model)``)
  (:mod:`octacloud.toolchain.torchsource`);
- an **ONNX** file (:class:`OnnxSource`).

torch and transformers are imported only when a PyTorch or Hugging Face source is loaded.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import numpy as np
import onnx

from octacloud.toolchain.errors import SourceError
from octacloud.toolchain.onnxgraph import check_model, open_session, run, signature
from octacloud.toolchain.preprocessing import Preprocessing
from octacloud.toolchain.spec import TensorSpec, make_samples

SourceKind = Literal["auto", "huggingface", "torch", "onnx"]
Task = Literal["auto", "image-classification", "text-classification", "sentence-embedding", "feature-extraction"]


class SourceModel(Protocol):
    """A model to convert.

    Implementations guarantee that :attr:`inputs` name, type and shape the inputs of the graph that
    :meth:`export` writes (batch axis first and dynamic), that :meth:`reference` runs the *source* framework
    (not the export) in inference mode and is deterministic, and that :meth:`sample_inputs` is deterministic
    for a given generator.
    """

    @property
    def description(self) -> str:
        """What the source is, for messages (``BertModel sentence-embedding (trained weights)``)."""
        ...

    @property
    def reference_name(self) -> str:
        """What parity compares with (``torch``)."""
        ...

    @property
    def inputs(self) -> Sequence[TensorSpec]: ...

    @property
    def classifier(self) -> bool:
        """Whether the (first) output holds class scores, so that top-1 agreement is checked."""
        ...

    @property
    def shape_hints(self) -> Mapping[str, int]:
        """Sizes of dynamic non-batch axes (sequence length) used for samples, by input name."""
        ...

    @property
    def preprocessing(self) -> Preprocessing | None:
        """The tokenizer or image recipe published with the model (``None``: the inputs go in as they are)."""
        ...

    def sample_inputs(self, batch: int, rng: np.random.Generator) -> dict[str, np.ndarray]: ...

    def reference(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def export(self, dst: Path) -> None:
        """Write the fp32 ONNX graph to ``dst``; raise :class:`~octacloud.toolchain.errors.ConversionError`."""
        ...


@dataclass(frozen=True, slots=True)
class SourceOptions:
    """How to read a source; most fields only matter for some kinds."""

    kind: SourceKind = "auto"
    task: Task = "auto"
    inputs: tuple[TensorSpec, ...] = ()
    """Input signature of a PyTorch module (its ``forward`` arguments, in order)."""
    output_names: tuple[str, ...] = ()
    classifier: bool | None = None
    random_init: bool = False
    """Hugging Face: build the architecture from ``config.json`` with seeded weights, ignoring any weights."""
    seed: int = 0
    sequence_length: int = 16
    """Length of the sample sequences of text models (parity and profiling)."""


class OnnxSource:
    """An existing ONNX file. Its reference is onnxruntime running the file exactly as given.

    A file exported with a fixed batch size (``[1, ...]``, as exporters do without dynamic axes) is published
    with a dynamic batch axis; its reference then runs one sample at a time. If the graph itself depends on
    that size (a ``Reshape`` to a constant shape), running the variants fails with a message saying so.
    """

    reference_name = "onnxruntime (source .onnx)"

    def __init__(self, path: Path, options: SourceOptions) -> None:
        self.path = path
        model = check_model(path)
        self.inputs, outputs = signature(model)
        if not self.inputs:
            raise SourceError(f"{path}: the model has no inputs")
        self.description = f"ONNX {path.name} ({', '.join(s.describe() for s in self.inputs)})"
        if not outputs:
            raise SourceError(f"{path}: the model has no outputs")
        # An ONNX file does not say whether its output holds class scores: the user (or the task) does.
        classify = options.task in ("image-classification", "text-classification")
        self.classifier = options.classifier if options.classifier is not None else classify
        self.shape_hints = {s.name: options.sequence_length for s in self.inputs}
        self.fixed_batch = _fixed_batch(model)
        self.preprocessing: Preprocessing | None = None  # an ONNX file says nothing: convert --tokenizer adds it
        self._session = open_session(path)

    def sample_inputs(self, batch: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return make_samples(self.inputs, batch, rng, self.shape_hints)

    def reference(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.fixed_batch is None:
            return run(self._session, inputs)
        n = next(iter(inputs.values())).shape[0]
        step = self.fixed_batch
        if n % step:
            raise SourceError(f"{self.path.name} takes batches of exactly {step}; {n} samples cannot be split")
        parts = [run(self._session, {k: v[i : i + step] for k, v in inputs.items()}) for i in range(0, n, step)]
        return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}

    def export(self, dst: Path) -> None:
        if self.fixed_batch is None:
            shutil.copyfile(self.path, dst)
            return
        model = onnx.load(str(self.path))
        initializers = {i.name for i in model.graph.initializer}
        for value in [*model.graph.input, *model.graph.output]:
            dims = value.type.tensor_type.shape.dim
            if value.name not in initializers and dims:
                dims[0].Clear()
                dims[0].dim_param = "batch"
        del model.graph.value_info[:]  # inferred intermediate shapes carry the old fixed batch
        onnx.save(model, str(dst))


def _fixed_batch(model: onnx.ModelProto) -> int | None:
    """The fixed size of the inputs' first axis, or ``None`` when it is dynamic."""
    initializers = {i.name for i in model.graph.initializer}
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        if value.name not in initializers and dims and dims[0].HasField("dim_value") and dims[0].dim_value > 0:
            return int(dims[0].dim_value)
    return None


def detect_kind(path: Path) -> SourceKind:
    if path.is_dir():
        if (path / "config.json").is_file():
            return "huggingface"
        raise SourceError(f"{path} is a directory without config.json: not a Hugging Face model directory")
    if path.name == "config.json":
        return "huggingface"
    if path.suffix == ".onnx":
        return "onnx"
    if path.suffix in (".pt", ".pth", ".ts", ".torchscript", ".bin", ".pkl"):
        return "torch"
    raise SourceError(f"cannot tell what kind of model {path} is; pass --kind huggingface|torch|onnx")


def load_source(path: str | Path, options: SourceOptions | None = None) -> SourceModel:
    """Open a source model; a missing file or an unknown kind raises :class:`SourceError` naming it."""
    p = Path(path)
    opts = options or SourceOptions()
    if not p.exists():
        raise SourceError(f"source model {p} does not exist")
    kind = detect_kind(p) if opts.kind == "auto" else opts.kind
    if kind == "onnx":
        return OnnxSource(p, opts)
    if kind == "torch":
        from octacloud.toolchain.torchsource import load_torch_file

        return load_torch_file(p, opts)
    from octacloud.toolchain.huggingface import load_huggingface

    return load_huggingface(p, opts)
