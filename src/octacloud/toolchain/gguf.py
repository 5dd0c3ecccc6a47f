"""Generative models into the repository: a GGUF file becomes ``<model>/config.pbtxt`` + ``<model>/<v>/``.

The config names the engine (``backend: "llama.cpp"``) and records what sizing needs from the GGUF's metadata:
its bytes (``octacloud.weights_bytes``), the KV cache one token costs (``octacloud.llm.kv_elements_per_token``),
the context it was trained for, its vocabulary and embedding width. The version folder holds ``model.gguf``,
the engine's arguments (``model.json``, serving/generate/args.py) and, read out of the GGUF, the model's
tokenizer and chat template as Hugging Face files (``tokenizer.json``, ``tokenizer_config.json``) for clients
and tools that count tokens themselves. Nothing is converted: the GGUF is served as it is (its quantization is
the publisher's choice).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from octacloud.core.errors import InvalidSpecError
from octacloud.serving.generate.args import (
    ENGINE_ARGS_FILE,
    LLAMA_CPP_BACKEND,
    PARAM_CONTEXT_MAX,
    PARAM_EMBEDDING,
    PARAM_KV_ELEMENTS,
    PARAM_VOCAB,
    EngineArgs,
)
from octacloud.toolchain.repository import WEIGHTS_BYTES_PARAM, ModelRepository

GGUF_FILENAME = "model.gguf"
PARAM_DESCRIPTION = "octacloud.llm.description"
PARAM_CHAT_TEMPLATE = "octacloud.llm.chat_template"
"""``"gguf"`` when the GGUF carries a chat template (the engine applies it to ``/v1/chat/completions``)."""


@dataclass(frozen=True, slots=True)
class GgufModel:
    """What the GGUF's metadata says, as sizing and serving need it."""

    path: Path
    architecture: str
    name: str
    context_max: int
    layers: int
    embedding_length: int
    kv_elements_per_token: int
    vocab_size: int
    chat_template: str | None
    weights_bytes: int


def read_gguf(path: Path) -> GgufModel:
    """Read a GGUF's header (the ``gguf`` package, llama.cpp's own reader); :class:`InvalidSpecError` naming
    what is missing."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (OSError, ValueError) as e:
        raise InvalidSpecError(f"{path}: not a GGUF file: {e}") from None

    def value(key: str, default: Any = None) -> Any:
        field = reader.get_field(key)
        if field is None:
            if default is None:
                raise InvalidSpecError(f"{path}: the GGUF metadata has no {key!r}")
            return default
        return field.contents()

    arch = str(value("general.architecture"))
    layers = int(value(f"{arch}.block_count"))
    width = int(value(f"{arch}.embedding_length"))
    heads = int(value(f"{arch}.attention.head_count"))
    kv_heads = int(value(f"{arch}.attention.head_count_kv", heads))
    head_dim = width // heads
    key_length = int(value(f"{arch}.attention.key_length", head_dim))
    value_length = int(value(f"{arch}.attention.value_length", head_dim))
    tokens = reader.get_field("tokenizer.ggml.tokens")
    vocab = int(value(f"{arch}.vocab_size", len(tokens.data) if tokens is not None else 0))
    if not vocab:
        raise InvalidSpecError(f"{path}: the GGUF has no vocabulary ({arch}.vocab_size, tokenizer.ggml.tokens)")
    template = reader.get_field("tokenizer.chat_template")
    return GgufModel(
        path=path,
        architecture=arch,
        name=str(value("general.name", path.stem)),
        context_max=int(value(f"{arch}.context_length")),
        layers=layers,
        embedding_length=width,
        kv_elements_per_token=layers * kv_heads * (key_length + value_length),
        vocab_size=vocab,
        chat_template=str(template.contents()) if template is not None else None,
        weights_bytes=path.stat().st_size,
    )


def generative_config(name: str, model: GgufModel) -> mc.ModelConfig:
    """The ``config.pbtxt`` of a GGUF model (inputs and outputs are filled in by the replica at load)."""
    config = mc.ModelConfig(name=name, backend=LLAMA_CPP_BACKEND, max_batch_size=0)
    params: dict[str, str] = {
        WEIGHTS_BYTES_PARAM: str(model.weights_bytes),
        PARAM_KV_ELEMENTS: str(model.kv_elements_per_token),
        PARAM_CONTEXT_MAX: str(model.context_max),
        PARAM_VOCAB: str(model.vocab_size),
        PARAM_EMBEDDING: str(model.embedding_length),
        PARAM_DESCRIPTION: f"{model.name} ({model.architecture}, {model.layers} layers)",
    }
    if model.chat_template:
        params[PARAM_CHAT_TEMPLATE] = "gguf"
    for key, text in params.items():
        config.parameters[key].string_value = text
    return config


def _tokenizer_files(gguf: Path, into: Path) -> list[str]:
    """The GGUF's tokenizer and chat template as ``tokenizer.json`` + ``tokenizer_config.json`` (transformers'
    GGUF reader); nothing when transformers cannot read this GGUF's tokenizer."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
        written = tokenizer.save_pretrained(str(into))
    except Exception:  # an architecture transformers does not convert: the engine's own tokenizer still serves
        return []
    return sorted(Path(p).name for p in written if Path(p).is_file())


@dataclass(frozen=True, slots=True)
class PublishedGguf:
    name: str
    version: int
    path: Path
    model: GgufModel
    engine: EngineArgs
    files: tuple[str, ...]


def publish_gguf(
    source: Path, repository: Path, name: str, engine: Mapping[str, Any] | None = None, *, link: bool = False
) -> PublishedGguf:
    """Publish ``source`` (a ``.gguf``) as the next version of ``name`` with engine arguments ``engine``
    (``model.json``; checked against the model). ``link``: hard-link the GGUF instead of copying it, where the
    file system allows."""
    model = read_gguf(source)
    args = EngineArgs.parse({"model": GGUF_FILENAME, **(engine or {})}, "the engine arguments")
    if args.context_length > model.context_max:
        raise InvalidSpecError(
            f"context_length {args.context_length} is over the {model.context_max} tokens {model.name} was trained for"
        )
    repo = ModelRepository(repository)
    existing = repo.root / name / "config.pbtxt"
    if existing.is_file() and repo.config(name).backend != LLAMA_CPP_BACKEND:
        raise InvalidSpecError(f"model {name!r} in {repository} is not a generative model; publish under a new name")
    with repo.staging() as area:
        staged = area / "version"
        staged.mkdir()
        target = staged / GGUF_FILENAME
        if link:
            try:
                os.link(source, target)
            except OSError:
                shutil.copyfile(source, target)
        else:
            shutil.copyfile(source, target)
        raw = {k: list(v) if isinstance(v, tuple) else v for k, v in _asdict(args).items()}
        (staged / ENGINE_ARGS_FILE).write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
        files = _tokenizer_files(source, staged)
        version, path = repo.publish_files(name, staged, generative_config(name, model))
    return PublishedGguf(name, version, path, model, args, (GGUF_FILENAME, ENGINE_ARGS_FILE, *files))


def _asdict(args: EngineArgs) -> dict[str, Any]:
    return {f: getattr(args, f) for f in EngineArgs.__dataclass_fields__}
