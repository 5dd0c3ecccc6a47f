"""``octacloud convert``: a PyTorch / Hugging Face / ONNX model → versioned fp32/fp16/int8 ONNX models.

Exit status: 0 every requested variant was published; 1 some variant was outside tolerance and not published
(the others were); 2 nothing was published because the input was wrong (the message says what).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from octacloud.core.errors import OctacloudError

if TYPE_CHECKING:
    from octacloud.toolchain.convert import ConversionResult, ConvertOptions
    from octacloud.toolchain.profiling import ProfileSettings
    from octacloud.toolchain.sources import SourceOptions

_err = Console(stderr=True, soft_wrap=True)  # messages keep whole paths on one line


def _out() -> Console:
    """stdout; wide enough for the tables when it is not a terminal (logs, CI)."""
    return Console(width=None if sys.stdout.isatty() else 180)


def register(app: typer.Typer) -> None:
    app.command("convert")(convert_command)


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise typer.BadParameter(f"must be comma-separated integers, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise typer.BadParameter(f"batch sizes must be >= 1, got {text!r}")
    return sizes


_SOURCE = typer.Argument(
    ..., help="HF model dir (or its config.json), .pt/.pth (TorchScript or torch.save'd module), or .onnx file."
)
_NAME = typer.Option(..., "--name", "-n", help="Model name in the repository (variants get _fp16/_int8).")
_REPOSITORY = typer.Option(Path("models"), "--repository", "--repo", help="Model repository folder.")
_PUBLISH = typer.Option(
    None,
    "--publish",
    help="Publish into this model store instead of --repository: s3://bucket/prefix, "
    "another fsspec URL, or a folder (docs/storage.md).",
)
_STORAGE_CREDENTIALS = typer.Option(None, help="S3 credentials file for --publish (AWS format).")
_KIND = typer.Option("auto", help="auto | huggingface | torch | onnx.")
_TASK = typer.Option(
    "auto",
    help="auto | image-classification | text-classification | sentence-embedding | feature-extraction (Hugging Face).",
)
_INPUTS = typer.Option(
    [], "--input", help="PyTorch input NAME:DTYPE:SHAPE, e.g. input:float32:-1,256 (first axis -1 = batch)."
)
_OUTPUTS = typer.Option([], "--output", help="PyTorch output name(s), in order.")
_CLASSIFIER = typer.Option(
    None, "--classifier/--not-classifier", help="Check top-1 agreement (default: from the model)."
)
_PRECISION = typer.Option([], "--precision", "-p", help="fp32 | fp16 | int8 (repeat; default all).")
_MAX_BATCH_SIZE = typer.Option(32, help="max_batch_size of the published config.")
_CALIBRATION = typer.Option(None, help=".npz calibration set (one array per input): static int8.")
_SAMPLES = typer.Option(None, help=".npz parity inputs (default: seeded random samples).")
_RANDOM_INIT = typer.Option(False, help="Hugging Face: build from config.json with seeded weights.")
_SEED = typer.Option(0, help="Seed of sample inputs and random weights.")
_SEQUENCE_LENGTH = typer.Option(16, help="Sequence length of sample inputs for text models.")
_THREADS = typer.Option(0, help="onnxruntime threads for parity and profiling (0: up to 2).")
_BATCH_SIZES = typer.Option("1,2,4,8,16,32", help="Batch sizes to profile (up to --max-batch-size).")
_PROFILE_SECONDS = typer.Option(1.0, help="Time spent profiling each batch size.")
_TOLERANCE = typer.Option(
    [],
    help="Override a parity tolerance: PRECISION:FIELD=VALUE[,...], e.g. "
    "int8:min_cosine=0.99 (fields: min_cosine, max_rel_error, "
    "min_top1_agreement; 'none' turns a check off).",
)
_FORCE = typer.Option(False, "--force", help="Publish variants outside parity tolerance too.")
_TOKENIZER = typer.Option(
    None,
    help="Text models: tokenizer.json (or its folder) to publish with the model, so that it takes raw text "
    "(default: the one in a Hugging Face source's folder).",
)
_MAX_TEXT_LENGTH = typer.Option(
    None, help="Text models: tokens per text row, padded and truncated (default: 128, or the model's limit)."
)
_ENGINE_ARG = typer.Option(
    [],
    "--engine-arg",
    help="A .gguf (generative model): an engine argument KEY=VALUE for its model.json, e.g. parallel=8, "
    "context_length=4096 (repeat; docs/llm.md lists them).",
)


def convert_command(
    source: Path = _SOURCE,
    name: str = _NAME,
    repository: Path = _REPOSITORY,
    publish: str | None = _PUBLISH,
    storage_credentials: Path | None = _STORAGE_CREDENTIALS,
    kind: str = _KIND,
    task: str = _TASK,
    inputs: list[str] = _INPUTS,
    outputs: list[str] = _OUTPUTS,
    classifier: bool | None = _CLASSIFIER,
    precision: list[str] = _PRECISION,
    max_batch_size: int = _MAX_BATCH_SIZE,
    calibration: Path | None = _CALIBRATION,
    samples: Path | None = _SAMPLES,
    random_init: bool = _RANDOM_INIT,
    seed: int = _SEED,
    sequence_length: int = _SEQUENCE_LENGTH,
    threads: int = _THREADS,
    batch_sizes: str = _BATCH_SIZES,
    profile_seconds: float = _PROFILE_SECONDS,
    tolerance: list[str] = _TOLERANCE,
    force: bool = _FORCE,
    tokenizer: Path | None = _TOKENIZER,
    max_text_length: int | None = _MAX_TEXT_LENGTH,
    engine_arg: list[str] = _ENGINE_ARG,
) -> None:
    """Convert SOURCE to ONNX (fp32, fp16, int8), check parity, profile, and publish into the repository; a
    ``.gguf`` (a generative model) is published as it is, for llama.cpp's engine."""
    _require_build()
    if source.suffix.lower() == ".gguf":
        _publish_gguf(source, name, repository, engine_arg)
        return
    try:
        source_options = _source_options(kind, task, inputs, outputs, classifier, random_init, seed, sequence_length)
        options = _convert_options(
            name, precision, max_batch_size, calibration, samples, force, tolerance, seed, tokenizer,
            max_text_length, (threads, batch_sizes, profile_seconds),
        )  # fmt: skip
        result = _convert(source, source_options, options, publish, storage_credentials, repository)
    except OctacloudError as e:
        _err.print(f"[red]convert failed:[/] {e}\n[dim]nothing was published to {publish or repository}[/]")
        raise typer.Exit(2) from None
    _print_result(result)


def _source_options(
    kind: str,
    task: str,
    inputs: list[str],
    outputs: list[str],
    classifier: bool | None,
    random_init: bool,
    seed: int,
    sequence_length: int,
) -> SourceOptions:
    """How to read the source, from its options (``--input`` specs parsed, ``--kind`` and ``--task`` checked)."""
    from octacloud.toolchain.sources import SourceOptions
    from octacloud.toolchain.spec import parse_input_spec

    source_options = SourceOptions(
        kind=kind,  # type: ignore[arg-type]  # checked by load_source
        task=task,  # type: ignore[arg-type]
        inputs=tuple(parse_input_spec(i) for i in inputs),
        output_names=tuple(outputs),
        classifier=classifier,
        random_init=random_init,
        seed=seed,
        sequence_length=sequence_length,
    )
    _check_choice("--kind", kind, ("auto", "huggingface", "torch", "onnx"))
    _check_choice("--task", task, TASKS)
    return source_options


def _print_result(result: ConversionResult) -> None:
    """The conversion's table; exit status 1 when a variant was not published for its parity."""
    _out().print(result_table(result))
    if result.rejected:
        names = ", ".join(v.name for v in result.rejected)
        _err.print(
            f"[yellow]not published (outside parity tolerance):[/] {names}; see their failures above, "
            "or pass --force to publish them anyway"
        )
        raise typer.Exit(1)


TASKS = ("auto", "image-classification", "text-classification", "sentence-embedding", "feature-extraction")


def _require_build() -> None:
    """The ``build`` extra (torch, transformers, onnx) is installed, or exit 2 saying how to install it."""
    from octacloud.core.extras import require

    try:
        require("build")
    except OctacloudError as e:
        _err.print(f"[red]convert failed:[/] {e}")
        raise typer.Exit(2) from None


def _profile_settings(threads: int, batch_sizes: str, seconds: float, seed: int) -> ProfileSettings:
    from octacloud.toolchain.profiling import ProfileSettings

    return ProfileSettings(
        threads=threads or min(2, os.cpu_count() or 1), batch_sizes=_sizes(batch_sizes), budget_s=seconds, seed=seed
    )


def _convert_options(
    name: str,
    precision: list[str],
    max_batch_size: int,
    calibration: Path | None,
    samples: Path | None,
    force: bool,
    tolerance: list[str],
    seed: int,
    tokenizer: Path | None,
    max_text_length: int | None,
    profile: tuple[int, str, float],
) -> ConvertOptions:
    """The conversion's options from the command's (precisions default to all three; tolerances override the
    defaults field by field; ``profile``: threads, batch sizes and seconds per batch size)."""
    from octacloud.toolchain.convert import ConvertOptions
    from octacloud.toolchain.parity import DEFAULT_TOLERANCES, parse_tolerance

    return ConvertOptions(
        name=name,
        precisions=tuple(precision) or ("fp32", "fp16", "int8"),  # type: ignore[arg-type]  # validated
        max_batch_size=max_batch_size,
        calibration=calibration,
        samples=samples,
        force=force,
        tolerances={**DEFAULT_TOLERANCES, **dict(parse_tolerance(t) for t in tolerance)},
        seed=seed,
        tokenizer=tokenizer,
        max_text_length=max_text_length,
        profile=_profile_settings(*profile, seed),
    )


def _convert(
    source: Path,
    source_options: SourceOptions,
    options: ConvertOptions,
    publish: str | None,
    storage_credentials: Path | None,
    repository: Path,
) -> ConversionResult:
    """Load ``source`` and convert it into ``--publish``'s store or the repository folder."""
    from octacloud.toolchain.convert import convert
    from octacloud.toolchain.repository import ModelRepository
    from octacloud.toolchain.sources import load_source
    from octacloud.toolchain.store import StoreRepository, repository_for

    src = load_source(source, source_options)
    target = repository_for(publish, storage_credentials) if publish else ModelRepository(repository)
    try:
        return convert(src, target, options, progress=lambda m: _err.print(f"[dim]{m}[/]"))
    finally:
        if isinstance(target, StoreRepository):
            target.close()


def _publish_gguf(source: Path, name: str, repository: Path, engine_arg: list[str]) -> None:
    from octacloud.toolchain.gguf import publish_gguf

    engine: dict[str, object] = {}
    for item in engine_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"must be KEY=VALUE, got {item!r}", param_hint="--engine-arg")
        engine[key] = int(value) if value.isdigit() else value
    try:
        published = publish_gguf(source, repository, name, engine)
    except OctacloudError as e:
        _err.print(f"[red]convert failed:[/] {e}\n[dim]nothing was published to {repository}[/]")
        raise typer.Exit(2) from None
    model, args = published.model, published.engine
    _out().print(
        f"published {name} version {published.version} ({model.name}: {model.architecture}, "
        f"{model.weights_bytes / 2**20:.1f} MiB, trained context {model.context_max}) with "
        f"{', '.join(published.files)}; {args.parallel} sequence(s) × {args.context_length} tokens"
    )


def _check_choice(option: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise typer.BadParameter(f"must be one of {', '.join(choices)}; got {value!r}", param_hint=option)


def result_table(result: ConversionResult) -> Table:
    """The parity and profile of every variant of a conversion, one row each."""
    table = Table(title=f"octacloud convert: {result.source}")
    for col in (
        "model",
        "version",
        "size MiB",
        "max abs err",
        "max rel err",
        "min cosine",
        "top-1",
        "parity",
        "weights MiB",
        "bytes/sample",
        "peak samples/s (batch)",
    ):
        table.add_column(col, justify="left" if col in ("model", "parity") else "right")
    for v in result.variants:
        worst = max(v.parity.outputs, key=lambda o: o.max_rel_error)
        cos = min(o.min_cosine for o in v.parity.outputs)
        top1 = worst.top1_agreement
        status = "[green]ok[/]" if v.parity.passed else ("[yellow]forced[/]" if v.parity.forced else "[red]rejected[/]")
        peak = v.profile.peak if v.profile else None
        table.add_row(
            v.name,
            str(v.published.version) if v.published else "-",
            f"{v.file_bytes / 2**20:.1f}",
            f"{worst.max_abs_error:.3g}",
            f"{worst.max_rel_error:.3g}",
            f"{cos:.6f}",
            "-" if top1 is None else f"{top1:.3f}",
            status if v.parity.passed else f"{status} {'; '.join(v.parity.failures)}",
            f"{v.profile.weights_bytes / 2**20:.1f}" if v.profile else "-",
            f"{v.profile.bytes_per_sample:,}" if v.profile else "-",
            f"{peak.samples_per_s:,.1f} ({peak.batch_size})" if peak else "-",
        )
    return table
