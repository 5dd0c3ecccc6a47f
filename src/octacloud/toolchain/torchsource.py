"""PyTorch sources: a ``torch.nn.Module`` (built in Python, ``torch.save``-d, or TorchScript) and its export.

Export uses the ``torch.export``-based ONNX exporter (``dynamo=True``) with a dynamic batch axis and dynamic
axes where the input signature says so; TorchScript modules, which ``torch.export`` cannot trace, go through
the TorchScript exporter with the same dynamic axes. Only this module and :mod:`.huggingface` import torch.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from octacloud.toolchain.errors import ConversionError, SourceError
from octacloud.toolchain.preprocessing import Preprocessing
from octacloud.toolchain.sources import SourceOptions
from octacloud.toolchain.spec import TensorSpec, make_samples

OPSET = 20
_MISSING_OP = re.compile(r"No ONNX function found for <OpOverload\(op='([^']+)'")
_UNSUPPORTED = re.compile(r"(?:Unsupported|unsupported).{0,40}?operator[^']*'([^']+)'")


class TorchSource:
    """A ``torch.nn.Module`` whose ``forward`` takes the tensors of ``inputs`` in order."""

    reference_name = "torch"

    def __init__(
        self,
        module: torch.nn.Module,
        inputs: Sequence[TensorSpec],
        *,
        output_names: Sequence[str] = (),
        classifier: bool = False,
        description: str = "",
        shape_hints: Mapping[str, int] | None = None,
        dim_max: Mapping[int, int] | None = None,
        preprocessing: Preprocessing | None = None,
    ) -> None:
        if not inputs:
            raise SourceError(
                "a PyTorch module needs its input signature: pass --input NAME:DTYPE:SHAPE "
                "for each forward() argument, e.g. --input input:float32:-1,256"
            )
        self.module = module.eval()
        self.inputs = tuple(inputs)
        self.output_names = tuple(output_names)
        self.classifier = classifier
        self.description = description or type(module).__name__
        self.shape_hints = dict(shape_hints or {})
        self._dim_max = dict(dim_max or {})
        self.preprocessing = preprocessing

    def sample_inputs(self, batch: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return make_samples(self.inputs, batch, rng, self.shape_hints)

    def _call(self, inputs: Mapping[str, np.ndarray]) -> list[torch.Tensor]:
        args = [torch.from_numpy(np.ascontiguousarray(inputs[s.name])) for s in self.inputs]
        with torch.inference_mode():
            out: Any = self.module(*args)
        if isinstance(out, torch.Tensor):
            return [out]
        if isinstance(out, list | tuple) and all(isinstance(t, torch.Tensor) for t in out):
            return list(out)
        raise SourceError(
            f"{self.description}: forward() must return a tensor or a tuple of tensors, got {type(out).__name__}"
        )

    def _names(self, count: int) -> list[str]:
        if self.output_names:
            if len(self.output_names) != count:
                raise SourceError(
                    f"{self.description}: {len(self.output_names)} output name(s) given "
                    f"({list(self.output_names)}) but forward() returns {count} tensor(s)"
                )
            return list(self.output_names)
        return ["output"] if count == 1 else [f"output_{i}" for i in range(count)]

    def reference(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            outs = self._call(inputs)
        except SourceError:
            raise
        except Exception as e:
            raise SourceError(
                f"{self.description}: forward() failed on inputs {[s.describe() for s in self.inputs]}: {e}"
            ) from None
        return {n: t.detach().float().numpy() for n, t in zip(self._names(len(outs)), outs, strict=True)}

    def export(self, dst: Path) -> None:
        example = self.sample_inputs(2, np.random.default_rng(0))
        names = self._names(len(self._call(example)))
        args = tuple(torch.from_numpy(example[s.name]) for s in self.inputs)
        try:
            if isinstance(self.module, torch.jit.ScriptModule):
                self._export_torchscript(args, names, dst)
            else:
                self._export_dynamo(args, names, dst)
        except ConversionError:
            raise
        except Exception as e:
            raise ConversionError(_explain(e, self.description)) from None

    def _export_dynamo(self, args: tuple[torch.Tensor, ...], names: list[str], dst: Path) -> None:
        # The exporter's registry logs one warning per torchvision op when torchvision is absent: noise here.
        logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
        dims: dict[int, Any] = {}

        def dim(axis: int) -> Any:
            if axis not in dims:
                name = "batch" if axis == 0 else f"dim{axis}"
                dims[axis] = torch.export.Dim(name, min=1, max=self._dim_max.get(axis, 65536))
            return dims[axis]

        dynamic = tuple({a: dim(a) for a, d in enumerate(s.shape) if d is None} for s in self.inputs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # exporter chatter (axis renaming notes, deprecations in torch)
            program = torch.onnx.export(
                self.module,
                args,
                input_names=[s.name for s in self.inputs],
                output_names=names,
                dynamic_shapes=dynamic,
                dynamo=True,
                optimize=True,
                verbose=False,
                opset_version=OPSET,
            )
        if program is None:
            raise ConversionError(f"{self.description}: the exporter produced no program")
        program.save(str(dst))

    def _export_torchscript(self, args: tuple[torch.Tensor, ...], names: list[str], dst: Path) -> None:
        axes: dict[str, dict[int, str]] = {
            s.name: {a: ("batch" if a == 0 else f"dim{a}") for a, d in enumerate(s.shape) if d is None}
            for s in self.inputs
        }
        for n in names:
            axes[n] = {0: "batch"}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "legacy exporter" deprecation: the only one that takes TorchScript
            torch.onnx.export(
                self.module,
                args,
                str(dst),
                input_names=[s.name for s in self.inputs],
                output_names=names,
                dynamic_axes=axes,
                dynamo=False,
                opset_version=OPSET,
            )


def _explain(error: Exception, what: str) -> str:
    text = str(error)
    m = _MISSING_OP.search(text) or _UNSUPPORTED.search(text)
    if m:
        return (
            f"{what}: operator {m.group(1)!r} has no ONNX translation in torch {torch.__version__}'s exporter; "
            "rewrite it with supported operators or register an ONNX translation for it"
        )
    summary = text.split("## Exception summary", 1)[-1].strip()
    return f"{what}: export to ONNX failed: {summary[:800]}"


def load_torch_file(path: Path, options: SourceOptions) -> TorchSource:
    """A TorchScript archive or a ``torch.save``-d module. Unpickling runs code: load only trusted files."""
    module, kind = _load_module(path)
    return TorchSource(
        module,
        options.inputs,
        output_names=options.output_names,
        classifier=bool(options.classifier),
        description=f"{kind} {path.name}",
        shape_hints={s.name: options.sequence_length for s in options.inputs},
    )


def _load_module(path: Path) -> tuple[torch.nn.Module, str]:
    try:
        return torch.jit.load(str(path), map_location="cpu"), "TorchScript"  # type: ignore[no-untyped-call]
    except RuntimeError:
        pass  # not a TorchScript archive: try a pickled module
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=False)
    except Exception as e:
        raise SourceError(f"{path}: neither a TorchScript archive nor a torch.save file: {e}") from None
    if isinstance(obj, Mapping):
        raise SourceError(
            f"{path} holds a state_dict (weights only), not a module: save the whole module "
            "(torch.save(model) or torch.jit.save(torch.jit.script(model))), or convert a Hugging Face directory"
        )
    if not isinstance(obj, torch.nn.Module):
        raise SourceError(f"{path} holds a {type(obj).__name__}, not a torch.nn.Module")
    return obj, "torch.save"
