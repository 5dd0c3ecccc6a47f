"""Hugging Face sources: a model directory, a sentence-transformers directory, or an architecture built from
its ``config.json`` with seeded weights — wrapped so that the exported graph takes plain tensors.

Tasks and the graphs they export:

==========================  ============================================  ===================================
task                        inputs                                        output
==========================  ============================================  ===================================
``image-classification``    ``pixel_values`` float32 [N, C, H, W]         ``logits`` [N, labels]
``text-classification``     ``input_ids``, ``attention_mask``             ``logits`` [N, labels]
                            (+ ``token_type_ids`` for BERT-like models)
``sentence-embedding``      as above                                      ``sentence_embedding`` [N, hidden]:
                                                                          pooled (mean/cls/max) over the
                                                                          mask, L2-normalised if the model
                                                                          says so
``feature-extraction``      as above                                      ``last_hidden_state`` [N, S, hidden]
==========================  ============================================  ===================================
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from transformers.utils import logging as hf_logging

from octacloud.toolchain.errors import SourceError
from octacloud.toolchain.preprocessing import (
    DEFAULT_MAX_TEXT_LENGTH,
    TOKENIZER_FILE,
    ImagePreprocessing,
    Preprocessing,
)
from octacloud.toolchain.sources import SourceOptions, Task
from octacloud.toolchain.spec import TensorSpec
from octacloud.toolchain.torchsource import TorchSource

WEIGHT_FILES = (
    "model.safetensors",
    "pytorch_model.bin",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
)
DEFAULT_IMAGE_SIZE = 224


class ImageClassifier(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).logits  # type: ignore[no-any-return]


class TextModel(torch.nn.Module):
    """A text encoder with a head: ``logits``, pooled sentence embedding, or the last hidden state."""

    def __init__(self, model: torch.nn.Module, head: str, pooling: str = "mean", normalize: bool = False) -> None:
        super().__init__()
        self.model, self.head, self.pooling, self.normalize = model, head, pooling, normalize

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        kwargs: dict[str, torch.Tensor] = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        out = self.model(**kwargs)
        if self.head == "logits":
            return out.logits  # type: ignore[no-any-return]
        hidden: torch.Tensor = out.last_hidden_state
        if self.head == "hidden":
            return hidden
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        elif self.pooling == "max":
            pooled = hidden.masked_fill(mask == 0, torch.finfo(hidden.dtype).min).amax(dim=1)
        else:  # mean over the tokens the mask keeps (sentence-transformers' Pooling, mean mode)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2.0, dim=1) if self.normalize else pooled


class _TextSource(TorchSource):
    """Text samples that exercise the mask: sample ``i`` has its last ``i mod 4`` tokens padded."""

    def sample_inputs(self, batch: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        samples = super().sample_inputs(batch, rng)
        seq = samples["input_ids"].shape[1]
        for i in range(batch):
            pad = min(i % 4, seq - 1)
            if pad:
                samples["attention_mask"][i, seq - pad :] = 0
                samples["input_ids"][i, seq - pad :] = 0
        return samples


def _sentence_transformers_head(path: Path) -> tuple[str, bool] | None:
    """(pooling mode, normalise) if ``path`` is a sentence-transformers directory, else ``None``."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text(encoding="utf-8"))
    types = [str(m.get("type", "")) for m in modules]
    pooling = "mean"
    for m in modules:
        if str(m.get("type", "")).endswith("Pooling"):
            cfg_file = path / str(m.get("path", "")) / "config.json"
            cfg = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
            if cfg.get("pooling_mode_cls_token"):
                pooling = "cls"
            elif cfg.get("pooling_mode_max_tokens"):
                pooling = "max"
    return pooling, any(t.endswith("Normalize") for t in types)


def _task(config: Any, st_head: tuple[str, bool] | None, requested: Task) -> Task:
    if requested != "auto":
        return requested
    if st_head is not None:
        return "sentence-embedding"
    arch = (getattr(config, "architectures", None) or [""])[0]
    if arch.endswith("ForImageClassification"):
        return "image-classification"
    if arch.endswith("ForSequenceClassification"):
        return "text-classification"
    if hasattr(config, "num_channels") and not hasattr(config, "vocab_size"):
        return "image-classification"
    return "feature-extraction"


def _build(config: Any, path: Path, task: Task, random_init: bool, seed: int) -> torch.nn.Module:
    if task == "image-classification":
        auto: Any = transformers.AutoModelForImageClassification
    elif task == "text-classification":
        auto = transformers.AutoModelForSequenceClassification
    else:
        auto = transformers.AutoModel
    try:
        torch.manual_seed(seed)  # random init, or a head the checkpoint lacks: seeded either way
        if random_init:
            return auto.from_config(config)  # type: ignore[no-any-return]
        return auto.from_pretrained(str(path), config=config, local_files_only=True)  # type: ignore[no-any-return]
    except (OSError, ValueError, KeyError) as e:
        raise SourceError(f"{path}: transformers cannot build a {task} model from it: {e}") from None


def load_huggingface(path: Path, options: SourceOptions) -> TorchSource:
    """A Hugging Face model directory (or ``config.json``) as a :class:`TorchSource` with a plain-tensor API."""
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    directory = path.parent if path.is_file() else path
    random_init = options.random_init or path.is_file()
    if not (directory / "config.json").is_file():
        raise SourceError(f"{directory} has no config.json: not a Hugging Face model directory")
    if not random_init and not any((directory / f).is_file() for f in WEIGHT_FILES):
        raise SourceError(
            f"{directory} has no weights ({', '.join(WEIGHT_FILES[:2])}); pass --random-init to "
            "build the architecture from config.json with seeded weights"
        )
    try:
        config = transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise SourceError(f"{directory}/config.json is not a configuration transformers understands: {e}") from None
    st_head = _sentence_transformers_head(directory)
    task = _task(config, st_head, options.task)
    vision = hasattr(config, "num_channels") and not hasattr(config, "vocab_size")
    if vision and task != "image-classification":
        raise SourceError(
            f"{directory}: a vision model ({config.model_type}) converts for image-classification only, not {task}"
        )
    if not vision and task == "image-classification":
        raise SourceError(f"{directory}: {config.model_type} is not a vision model; choose a text task")
    model = _build(config, directory, task, random_init, options.seed).eval()
    arch, origin = type(model).__name__, "seeded weights" if random_init else "trained weights"
    if task == "image-classification":
        return _image_source(model, config, None if path.is_file() else directory, options, f"{arch} ({origin})")
    return _text_source(model, config, directory, task, st_head, options, f"{arch} {task} ({origin})")


def _image_source(
    model: Any, config: Any, folder: Path | None, options: SourceOptions, description: str
) -> TorchSource:
    """An image classifier: pixel values in, logits out, with the preprocessing ``folder``'s files describe."""
    size = int(getattr(config, "image_size", DEFAULT_IMAGE_SIZE) or DEFAULT_IMAGE_SIZE)
    channels = int(getattr(config, "num_channels", 3))
    spec = TensorSpec("pixel_values", "float32", (None, channels, size, size))
    image = ImagePreprocessing.from_source(folder, size)
    return TorchSource(
        ImageClassifier(model),
        [spec],
        output_names=["logits"],
        classifier=True if options.classifier is None else options.classifier,
        description=description,
        preprocessing=Preprocessing(image=image),
    )


def _text_source(
    model: Any,
    config: Any,
    directory: Path,
    task: str,
    st_head: tuple[str, bool] | None,
    options: SourceOptions,
    description: str,
) -> TorchSource:
    """A text model: token ids (and mask, and types where it has them) in; logits, a pooled sentence embedding or
    the last hidden state out; with the folder's tokenizer, if it has one."""
    vocab = int(getattr(config, "vocab_size", 2))
    inputs = [
        TensorSpec("input_ids", "int64", (None, None), low=0, high=vocab),
        TensorSpec("attention_mask", "int64", (None, None), low=0, high=2),
    ]
    if int(getattr(config, "type_vocab_size", 0) or 0) > 0:
        inputs.append(TensorSpec("token_type_ids", "int64", (None, None), low=0, high=1))
    if task == "text-classification":
        wrapper, output = TextModel(model, "logits"), "logits"
    elif task == "sentence-embedding":
        pooling, normalize = st_head if st_head is not None else ("mean", True)
        wrapper, output = TextModel(model, "pooled", pooling, normalize), "sentence_embedding"
    else:
        wrapper, output = TextModel(model, "hidden"), "last_hidden_state"
    max_len = int(getattr(config, "max_position_embeddings", 512) or 512)
    tokenizer = directory if (directory / TOKENIZER_FILE).is_file() else None
    preprocessing = Preprocessing(tokenizer, min(DEFAULT_MAX_TEXT_LENGTH, max_len)) if tokenizer else None
    return _TextSource(
        wrapper,
        inputs,
        output_names=[output],
        classifier=task == "text-classification" if options.classifier is None else options.classifier,
        description=description,
        shape_hints={s.name: options.sequence_length for s in inputs},
        dim_max={1: max_len},
        preprocessing=preprocessing,
    )
