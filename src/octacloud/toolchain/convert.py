"""``convert``: a source model → fp32/fp16/int8 ONNX variants, checked for parity, profiled, published.

The pipeline, all of it inside a staging directory of the repository:

1. export the source to ONNX (dynamic batch axis) and apply portable graph optimisations → the fp32 graph;
2. derive the fp16 graph and the int8 graph (dynamic quantization, or static with a calibration set);
3. run every variant on the same seeded sample inputs as the source framework and compare
   (:mod:`.parity`); a variant outside its tolerance is dropped unless ``force``;
4. profile each remaining variant (:mod:`.profiling`) and write its ``config.pbtxt``;
5. publish them all at once (:meth:`ModelRepository.publish`).

Any error before step 5 leaves the repository exactly as it was; step 5 is all or nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from octacloud.core.errors import InvalidSpecError
from octacloud.serving.text import TOKEN_INPUTS
from octacloud.toolchain.errors import ConversionError, SourceError
from octacloud.toolchain.onnxgraph import check_model, open_session, optimize_offline, run, signature
from octacloud.toolchain.parity import DEFAULT_TOLERANCES, PARITY_FILENAME, ParityReport, Tolerance, compare
from octacloud.toolchain.preprocessing import Preprocessing, tokenizer_file, write_tokenizer
from octacloud.toolchain.profile import PRECISIONS, ModelProfile, Precision
from octacloud.toolchain.profiling import ProfileSettings, measure_profile
from octacloud.toolchain.repository import (
    MODEL_FILENAME,
    ModelRepository,
    PublishedVersion,
    StagedModel,
    build_config,
    check_model_name,
    variant_name,
)
from octacloud.toolchain.sources import SourceModel
from octacloud.toolchain.spec import TensorSpec, check_batch
from octacloud.toolchain.variants import (
    CalibrationSet,
    load_arrays,
    load_calibration,
    to_fp16,
    to_int8_dynamic,
    to_int8_static,
)


@dataclass(frozen=True, slots=True)
class ConvertOptions:
    name: str
    precisions: tuple[Precision, ...] = PRECISIONS
    max_batch_size: int = 32
    calibration: Path | Mapping[str, np.ndarray] | None = None
    """int8 calibration set (an ``.npz`` path or arrays by input name): static quantization when given."""
    tolerances: Mapping[Precision, Tolerance] = field(default_factory=lambda: dict(DEFAULT_TOLERANCES))
    force: bool = False
    """Publish variants outside tolerance too (their parity report says so)."""
    samples: Path | Mapping[str, np.ndarray] | None = None
    """Parity inputs (an ``.npz`` path or arrays by input name); default: ``parity_samples`` seeded samples."""
    parity_samples: int = 8
    seed: int = 0
    profile: ProfileSettings = field(default_factory=ProfileSettings)
    max_queue_delay_us: int = 2000
    tokenizer: Path | None = None
    """A text model's tokenizer (a folder holding ``tokenizer.json``, or the file), published with it; default:
    the one in the source's folder, if any."""
    max_text_length: int | None = None
    """Tokens per text row (padding and truncation); default: the source's, else 128."""

    def __post_init__(self) -> None:
        check_model_name(self.name)
        if not self.precisions:
            raise InvalidSpecError("at least one precision (fp32, fp16, int8) is needed")
        bad = [p for p in self.precisions if p not in PRECISIONS]
        if bad:
            raise InvalidSpecError(f"unknown precision(s) {bad}; choose from {list(PRECISIONS)}")
        if len(set(self.precisions)) != len(self.precisions):
            raise InvalidSpecError(f"precisions repeat: {list(self.precisions)}")
        if self.max_batch_size < 1:
            raise InvalidSpecError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.parity_samples < 1:
            raise InvalidSpecError(f"parity_samples must be >= 1, got {self.parity_samples}")
        if self.max_text_length is not None and self.max_text_length < 1:
            raise InvalidSpecError(f"max_text_length must be >= 1, got {self.max_text_length}")


@dataclass(frozen=True, slots=True)
class VariantResult:
    name: str
    precision: Precision
    file_bytes: int
    parity: ParityReport
    profile: ModelProfile | None
    """``None`` when the variant was rejected (outside tolerance and not forced)."""
    published: PublishedVersion | None = None


@dataclass(frozen=True, slots=True)
class ConversionResult:
    source: str
    variants: tuple[VariantResult, ...]

    @property
    def published(self) -> tuple[VariantResult, ...]:
        return tuple(v for v in self.variants if v.published is not None)

    @property
    def rejected(self) -> tuple[VariantResult, ...]:
        return tuple(v for v in self.variants if v.published is None)


Progress = Callable[[str], None]


def _calibration(source: SourceModel, options: ConvertOptions) -> CalibrationSet | None:
    cal = options.calibration
    if cal is None:
        return None
    if isinstance(cal, Path):
        return load_calibration(cal, source.inputs)
    return CalibrationSet(source.inputs, cal, "(arrays)")


def _parity_inputs(source: SourceModel, options: ConvertOptions) -> dict[str, np.ndarray]:
    given = options.samples
    if given is None:
        return source.sample_inputs(options.parity_samples, np.random.default_rng(options.seed))
    arrays = load_arrays(given, "sample set") if isinstance(given, Path) else dict(given)
    try:
        check_batch(source.inputs, arrays, f"sample set {given if isinstance(given, Path) else '(arrays)'}")
    except InvalidSpecError as e:
        raise SourceError(str(e)) from None
    return {s.name: np.ascontiguousarray(arrays[s.name]).astype(s.dtype, copy=False) for s in source.inputs}


def _preprocessing(source: SourceModel, options: ConvertOptions) -> Preprocessing | None:
    """The source's pre-processing with the options' tokenizer and text length applied, checked."""
    found = source.preprocessing
    if options.tokenizer is None and options.max_text_length is None:
        return found
    base = found or Preprocessing()
    tokenizer = options.tokenizer or base.tokenizer
    if tokenizer is None:
        raise SourceError("--max-text-length needs a tokenizer: the source has none, pass --tokenizer")
    if not {s.name for s in source.inputs} & set(TOKEN_INPUTS):
        raise SourceError(
            f"a tokenizer is for text models, whose inputs include {list(TOKEN_INPUTS)}; "
            f"this model's are {[s.name for s in source.inputs]}"
        )
    tokenizer_file(tokenizer)  # a missing or misnamed file fails before any work
    return dataclasses.replace(
        base, tokenizer=tokenizer, max_text_length=options.max_text_length or base.max_text_length
    )


def _make_variant(
    precision: Precision, fp32: Path, dst: Path, calibration: CalibrationSet | None, workdir: Path
) -> list[str]:
    """Write the variant; returns notes for the user (activations left with per-batch scales)."""
    if precision == "fp32":
        dst.write_bytes(fp32.read_bytes())
    elif precision == "fp16":
        to_fp16(fp32, dst)
    elif calibration is not None:
        to_int8_static(fp32, dst, calibration, workdir)
    else:
        kept = to_int8_dynamic(fp32, dst).kept
        if kept:
            return [
                f"{len(kept)} activation(s) keep a per-batch scale, so serving never batches two requests "
                f"of this variant together: {'; '.join(kept)}"
            ]
    return []


def convert(
    source: SourceModel,
    repository: ModelRepository,
    options: ConvertOptions,
    progress: Progress | None = None,
) -> ConversionResult:
    """Convert ``source`` and publish its variants into ``repository`` (see the module docstring)."""
    say = progress or (lambda _msg: None)
    calibration = _calibration(source, options)  # a bad calibration set fails before any work
    names = {p: variant_name(options.name, p) for p in options.precisions}
    for n in names.values():
        check_model_name(n)
    preprocessing = _preprocessing(source, options)
    samples = _parity_inputs(source, options)
    reference = source.reference(samples)
    with repository.staging() as stage:
        work = stage / "work"
        work.mkdir()
        fp32, inputs, outputs = _export(source, work, say)
        for name in names.values():  # refuse a signature clash now, not after the variants are built
            placeholder = build_config(name, inputs, outputs, max_batch_size=options.max_batch_size,
                                       weights_bytes=0, bytes_per_sample=0, precision="fp32")  # fmt: skip
            repository.check_compatible(name, placeholder)
        build = _Build(
            source, options, fp32, work, inputs, outputs, calibration, preprocessing, samples, reference, say
        )
        results: list[VariantResult] = []
        staged: list[StagedModel] = []
        for precision in options.precisions:
            result, model = _variant(build, precision, names[precision], stage / names[precision])
            results.append(result)
            if model is not None:
                staged.append(model)
        published = {p.name: p for p in repository.publish(staged)}
    final = tuple(
        dataclasses.replace(r, published=published[r.name], profile=published[r.name].profile)
        if r.name in published
        else r
        for r in results
    )
    for r in final:
        if r.published is not None:
            say(f"published {r.name} version {r.published.version}")
    return ConversionResult(source.description, final)


def _export(source: SourceModel, work: Path, say: Progress) -> tuple[Path, list[TensorSpec], list[TensorSpec]]:
    """Export ``source`` to ONNX and optimise it offline into ``work/fp32.onnx``; its inputs and outputs, which
    must be the source's."""
    say(f"exporting {source.description} to ONNX")
    exported = work / "exported.onnx"
    source.export(exported)
    check_model(exported)
    fp32 = work / "fp32.onnx"
    optimize_offline(exported, fp32)
    inputs, outputs = signature(check_model(fp32))
    expected = [s.name for s in source.inputs]
    if [s.name for s in inputs] != expected:
        raise ConversionError(
            f"the exported graph's inputs {[s.name for s in inputs]} differ from the source's {expected}"
        )
    return fp32, inputs, outputs


@dataclass(frozen=True, slots=True)
class _Build:
    """What every variant of one conversion is built, checked and profiled from."""

    source: SourceModel
    options: ConvertOptions
    fp32: Path
    work: Path
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    calibration: CalibrationSet | None
    preprocessing: Preprocessing | None
    samples: dict[str, np.ndarray]
    reference: dict[str, np.ndarray]
    say: Progress


def _variant(b: _Build, precision: Precision, name: str, directory: Path) -> tuple[VariantResult, StagedModel | None]:
    """Build the ``precision`` variant into ``directory`` and check its parity; one within tolerance (or forced)
    is profiled and staged for publishing, one outside it is reported only."""
    options, preprocessing, say = b.options, b.preprocessing, b.say
    say(f"{name}: building the {precision} variant")
    directory.mkdir()
    path = directory / MODEL_FILENAME
    for note in _make_variant(precision, b.fp32, path, b.calibration, b.work):
        say(f"{name}: {note}")
    if preprocessing is not None and preprocessing.tokenizer is not None:
        write_tokenizer(preprocessing.tokenizer, directory, preprocessing.max_text_length)
    got = run(open_session(path, options.profile.threads), b.samples)
    report = compare(name, precision, got, b.reference, reference_name=b.source.reference_name,
                     classifier=b.source.classifier, tolerance=options.tolerances.get(precision),
                     forced=options.force)  # fmt: skip
    (directory / PARITY_FILENAME).write_text(report.to_json(), encoding="utf-8")
    size = path.stat().st_size
    if not report.publishable:
        say(f"{name}: outside tolerance, not published ({'; '.join(report.failures)})")
        return VariantResult(name, precision, size, report, None), None
    say(f"{name}: profiling")
    hints = {**b.source.shape_hints, **(options.profile.shape_hints or {})}
    profile = measure_profile(name, precision, path, b.inputs, options.max_batch_size,
                              dataclasses.replace(options.profile, shape_hints=hints))  # fmt: skip
    config = build_config(
        name,
        b.inputs,
        b.outputs,
        max_batch_size=options.max_batch_size,
        weights_bytes=profile.weights_bytes,
        bytes_per_sample=profile.bytes_per_sample,
        precision=precision,
        max_queue_delay_us=options.max_queue_delay_us,
        parameters=preprocessing.parameters() if preprocessing is not None else None,
    )
    return VariantResult(name, precision, size, report, profile), StagedModel(name, directory, config, profile)
