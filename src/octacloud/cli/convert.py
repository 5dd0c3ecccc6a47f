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
    from octacloud.toolchain.convert import ConversionResult

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


def convert_command(
    source: Path = typer.Argument(
        ..., help="HF model dir (or its config.json), .pt/.pth (TorchScript or torch.save'd module), or .onnx file."
    ),
    name: str = typer.Option(..., "--name", "-n", help="Model name in the repository (variants get _fp16/_int8)."),
    repository: Path = typer.Option(Path("models"), "--repository", "--repo", help="Model repository folder."),
    publish: str | None = typer.Option(
        None,
        "--publish",
        help="Publish into this model store instead of --repository: s3://bucket/prefix, "
        "another fsspec URL, or a folder (docs/storage.md).",
    ),
    storage_credentials: Path | None = typer.Option(None, help="S3 credentials file for --publish (AWS format)."),
    kind: str = typer.Option("auto", help="auto | huggingface | torch | onnx."),
    task: str = typer.Option(
        "auto",
        help="auto | image-classification | text-classification | "
        "sentence-embedding | feature-extraction (Hugging Face).",
    ),
    inputs: list[str] = typer.Option(
        [], "--input", help="PyTorch input NAME:DTYPE:SHAPE, e.g. input:float32:-1,256 (first axis -1 = batch)."
    ),
    outputs: list[str] = typer.Option([], "--output", help="PyTorch output name(s), in order."),
    classifier: bool | None = typer.Option(
        None, "--classifier/--not-classifier", help="Check top-1 agreement (default: from the model)."
    ),
    precision: list[str] = typer.Option([], "--precision", "-p", help="fp32 | fp16 | int8 (repeat; default all)."),
    max_batch_size: int = typer.Option(32, help="max_batch_size of the published config."),
    calibration: Path | None = typer.Option(None, help=".npz calibration set (one array per input): static int8."),
    samples: Path | None = typer.Option(None, help=".npz parity inputs (default: seeded random samples)."),
    random_init: bool = typer.Option(False, help="Hugging Face: build from config.json with seeded weights."),
    seed: int = typer.Option(0, help="Seed of sample inputs and random weights."),
    sequence_length: int = typer.Option(16, help="Sequence length of sample inputs for text models."),
    threads: int = typer.Option(0, help="onnxruntime threads for parity and profiling (0: up to 2)."),
    batch_sizes: str = typer.Option("1,2,4,8,16,32", help="Batch sizes to profile (up to --max-batch-size)."),
    profile_seconds: float = typer.Option(1.0, help="Time spent profiling each batch size."),
    tolerance: list[str] = typer.Option(
        [],
        help="Override a parity tolerance: PRECISION:FIELD=VALUE[,...], e.g. "
        "int8:min_cosine=0.99 (fields: min_cosine, max_rel_error, "
        "min_top1_agreement; 'none' turns a check off).",
    ),
    force: bool = typer.Option(False, "--force", help="Publish variants outside parity tolerance too."),
    tokenizer: Path | None = typer.Option(
        None,
        help="Text models: tokenizer.json (or its folder) to publish with the model, so that it takes raw text "
        "(default: the one in a Hugging Face source's folder).",
    ),
    max_text_length: int | None = typer.Option(
        None, help="Text models: tokens per text row, padded and truncated (default: 128, or the model's limit)."
    ),
    engine_arg: list[str] = typer.Option(
        [],
        "--engine-arg",
        help="A .gguf (generative model): an engine argument KEY=VALUE for its model.json, e.g. parallel=8, "
        "context_length=4096 (repeat; docs/llm.md lists them).",
    ),
) -> None:
    """Convert SOURCE to ONNX (fp32, fp16, int8), check parity, profile, and publish into the repository; a
    ``.gguf`` (a generative model) is published as it is, for llama.cpp's engine."""
    from octacloud.core.extras import require

    try:
        require("build")
    except OctacloudError as e:
        _err.print(f"[red]convert failed:[/] {e}")
        raise typer.Exit(2) from None
    if source.suffix.lower() == ".gguf":
        _publish_gguf(source, name, repository, engine_arg)
        return
    from octacloud.toolchain.convert import ConvertOptions, convert
    from octacloud.toolchain.parity import DEFAULT_TOLERANCES, parse_tolerance
    from octacloud.toolchain.profiling import ProfileSettings
    from octacloud.toolchain.repository import ModelRepository
    from octacloud.toolchain.sources import SourceOptions, load_source
    from octacloud.toolchain.spec import parse_input_spec
    from octacloud.toolchain.store import StoreRepository, repository_for

    try:
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
        _check_choice(
            "--task",
            task,
            ("auto", "image-classification", "text-classification", "sentence-embedding", "feature-extraction"),
        )
        options = ConvertOptions(
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
            profile=ProfileSettings(
                threads=threads or min(2, os.cpu_count() or 1),
                batch_sizes=_sizes(batch_sizes),
                budget_s=profile_seconds,
                seed=seed,
            ),
        )
        src = load_source(source, source_options)
        target = repository_for(publish, storage_credentials) if publish else ModelRepository(repository)
        try:
            result = convert(src, target, options, progress=lambda m: _err.print(f"[dim]{m}[/]"))
        finally:
            if isinstance(target, StoreRepository):
                target.close()
    except OctacloudError as e:
        _err.print(f"[red]convert failed:[/] {e}\n[dim]nothing was published to {publish or repository}[/]")
        raise typer.Exit(2) from None
    _out().print(result_table(result))
    if result.rejected:
        names = ", ".join(v.name for v in result.rejected)
        _err.print(
            f"[yellow]not published (outside parity tolerance):[/] {names}; see their failures above, "
            "or pass --force to publish them anyway"
        )
        raise typer.Exit(1)


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
