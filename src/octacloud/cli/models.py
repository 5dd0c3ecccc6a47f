"""``octacloud models``: build the example model repository, and list what a repository holds."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from octacloud.core.errors import OctacloudError

if TYPE_CHECKING:
    from octacloud.storage.store import ModelStore

models_app = typer.Typer(help="The example model repository, and what a repository holds.", no_args_is_help=True)
_err = Console(stderr=True, soft_wrap=True)  # messages keep whole paths on one line


def _out() -> Console:
    """stdout; wide enough for the tables when it is not a terminal (logs, CI)."""
    return Console(width=None if sys.stdout.isatty() else 180)


def register(app: typer.Typer) -> None:
    app.add_typer(models_app, name="models")


@models_app.command("build")
def build(
    out: Path = typer.Option(Path("models"), "--out", help="Repository folder to build into."),
    only: list[str] = typer.Option([], "--only", help="Build only these (mlp, resnet50, bert_base, minilm, smollm2)."),
    rebuild: bool = typer.Option(False, help="Rebuild even when the recorded fingerprint matches."),
    threads: int = typer.Option(0, help="onnxruntime threads for parity and profiling (0: up to 2)."),
) -> None:
    """Build the example models (seeded ResNet-50 and BERT-base, MiniLM-L6 with trained weights, a tiny MLP)."""
    from octacloud.cli.convert import result_table
    from octacloud.core.extras import require
    from octacloud.toolchain.examples import build_examples

    started = time.monotonic()
    try:
        require("build")
        outcomes = build_examples(
            out,
            only,
            rebuild=rebuild,
            threads=threads or None,
            progress=lambda m: _err.print(f"[dim]{time.monotonic() - started:6.1f}s {m}[/]"),
        )
    except OctacloudError as e:
        _err.print(f"[red]models build failed:[/] {e}")
        raise typer.Exit(2) from None
    console = _out()
    for o in outcomes:
        if o.result is not None:
            console.print(result_table(o.result))
    built = [o.name for o in outcomes if not o.skipped]
    skipped = [o.name for o in outcomes if o.skipped]
    console.print(
        f"{out}: built {built or 'nothing'}, up to date {skipped or 'nothing'} in {time.monotonic() - started:.1f} s"
    )


@models_app.command("list")
def list_models(
    repository: Path = typer.Option(Path("models"), "--repository", "--repo", help="Model repository folder."),
    storage: str | None = typer.Option(
        None, "--storage", "--model-storage", help="List this model store instead (s3://bucket/prefix, any fsspec URL)."
    ),
    storage_credentials: Path | None = typer.Option(None, help="S3 credentials file for --storage (AWS format)."),
) -> None:
    """Models, versions, sizes and measured throughput (from the latest version's profile.json)."""
    from octacloud.storage.store import StoreUnavailableError, open_store
    from octacloud.toolchain.profile import ModelProfile

    try:
        store = open_store(storage or repository, storage_credentials)
        names = store.models()
    except OctacloudError as e:
        _err.print(f"[red]models list failed:[/] {e}")
        raise typer.Exit(2) from None
    table = Table(title=f"models in {storage or repository}")
    for col in (
        "model",
        "versions",
        "precision",
        "stored MiB",
        "weights MiB",
        "bytes/sample",
        "p50 ms (batch 1)",
        "peak samples/s (batch)",
    ):
        table.add_column(col, justify="left" if col in ("model", "versions", "precision") else "right")
    for name in names:
        row = [name, "-", "-", "-"]
        try:
            found = store.versions(name)
            row = [name, ",".join(map(str, found)) or "-", "-", f"{store.size(name) / 2**20:.1f}"]
            generative = _generative_row(store, name, found)
            if generative is not None:
                row[2] = generative[0]
                table.add_row(*row, *generative[1:])
                continue
            p = ModelProfile.from_json(store.read(name, f"{found[-1]}/profile.json").decode()) if found else None
        except StoreUnavailableError as e:
            _err.print(f"[red]models list failed:[/] {e}")
            raise typer.Exit(2) from None
        except OctacloudError:  # no profile, or one that does not parse: the row says '-'
            p = None
        if p is None:
            table.add_row(*row, "-", "-", "-", "-")
            continue
        first, peak = p.batches[0], p.peak
        row[2] = p.precision
        table.add_row(
            *row,
            f"{p.weights_bytes / 2**20:.1f}",
            f"{p.bytes_per_sample:,}",
            f"{first.p50_ms:.2f}" if first.batch_size == 1 else "-",
            f"{peak.samples_per_s:,.1f} ({peak.batch_size})",
        )
    _out().print(table)


@models_app.command("publish")
def publish(
    source: Path = typer.Argument(..., help="A Triton-layout repository folder (e.g. the one `make models` built)."),
    storage: str = typer.Option(..., "--storage", "--model-storage", help="The model store to publish into."),
    storage_credentials: Path | None = typer.Option(None, help="S3 credentials file for --storage (AWS format)."),
    only: list[str] = typer.Option([], "--only", help="Publish only these models (repeat)."),
) -> None:
    """Publish a local repository's models into a model store, version numbers kept: each version's files, its
    manifest (SHA-256 per file: node caches verify it), then the model's config."""
    from octacloud.storage.publish import publish_folder
    from octacloud.storage.store import open_store

    try:
        store = open_store(storage, storage_credentials)
        done = publish_folder(store, source, list(only) or None)
    except OctacloudError as e:
        _err.print(f"[red]models publish failed:[/] {e}")
        raise typer.Exit(2) from None
    for p in done:
        what = "already there" if p.skipped else f"{p.files} file(s), {p.bytes / 2**20:.1f} MiB"
        _out().print(f"{store.url}/{p.model}/{p.version}: {what}", highlight=False)


def _generative_row(store: ModelStore, name: str, versions: list[int]) -> list[str] | None:
    """The columns from precision on of a generative model (its GGUF and engine arguments), or None for any other
    model."""
    from octacloud.serving.generate.args import ENGINE_ARGS_FILE, EngineArgs, ModelShape, is_generative
    from octacloud.serving.repository.config import CONFIG_FILE, parse_config
    from octacloud.storage.store import StoreUnavailableError

    try:
        config = parse_config(store.read(name, CONFIG_FILE).decode(), f"{name}/{CONFIG_FILE}")
        if not is_generative(config):
            return None
        shape = ModelShape.of(config)
        args = EngineArgs()
        if versions and ENGINE_ARGS_FILE in store.files(name, versions[-1]):
            args = EngineArgs.parse(json.loads(store.read(name, f"{versions[-1]}/{ENGINE_ARGS_FILE}")))
    except StoreUnavailableError:
        raise
    except (OctacloudError, ValueError):
        return ["llama.cpp", "-", "-", "-", "-"]
    return [
        "gguf (llama.cpp)",
        f"{shape.weights_bytes / 2**20:.1f}",
        f"{args.kv_bytes_per_token(shape) * args.context_length:,} (KV/sequence)",
        "-",
        f"{args.parallel} sequences × {args.context_length} tokens",
    ]
