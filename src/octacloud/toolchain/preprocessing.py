"""What a model needs done to its input before it runs, published with the model.

- **Text models** carry their tokenizer: ``tokenizer.json`` (a Hugging Face ``tokenizers`` file, padded and
  truncated to one length) and the files Hugging Face's ``AutoTokenizer`` reads beside it, in every version
  folder; the config names it (``octacloud.text.tokenizer``, ``octacloud.text.max_length``), so that the
  replica accepts raw text (:mod:`octacloud.serving.text`) and a client can tokenize exactly as the model
  expects.
- **Image models** state their input size and normalisation in the config's parameters
  (``octacloud.image.*``, :meth:`ImagePreprocessing.parameters`), read from the source's
  ``preprocessor_config.json`` when it has one.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from octacloud.serving.text import PARAM_MAX_LENGTH, PARAM_TOKENIZER
from octacloud.toolchain.errors import SourceError

TOKENIZER_FILE = "tokenizer.json"
COMPANION_FILES = ("tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
DEFAULT_MAX_TEXT_LENGTH = 128
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_PARAM_PREFIX = "octacloud.image."


@dataclass(frozen=True, slots=True)
class ImagePreprocessing:
    """How an image becomes the model's ``[N, 3, H, W]`` input: resize, centre crop, scale, normalise."""

    height: int
    width: int
    resize_shortest_edge: int
    """Resize so the shorter side has this many pixels (bilinear), then centre-crop ``height`` × ``width``."""
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    rescale: float = 1 / 255
    """Pixel values (0..255) are multiplied by this before ``(x - mean) / std``."""

    def parameters(self) -> dict[str, str]:
        def floats(values: tuple[float, ...]) -> str:
            return ",".join(f"{v:g}" for v in values)

        return {
            f"{IMAGE_PARAM_PREFIX}layout": "NCHW",
            f"{IMAGE_PARAM_PREFIX}channel_order": "RGB",
            f"{IMAGE_PARAM_PREFIX}height": str(self.height),
            f"{IMAGE_PARAM_PREFIX}width": str(self.width),
            f"{IMAGE_PARAM_PREFIX}resize_shortest_edge": str(self.resize_shortest_edge),
            f"{IMAGE_PARAM_PREFIX}rescale": f"{self.rescale:.10g}",
            f"{IMAGE_PARAM_PREFIX}mean": floats(self.mean),
            f"{IMAGE_PARAM_PREFIX}std": floats(self.std),
        }

    @classmethod
    def from_source(cls, directory: Path | None, size: int) -> ImagePreprocessing:
        """From a Hugging Face ``preprocessor_config.json`` in ``directory``; ImageNet's convention otherwise
        (resize the shorter side to size / 0.875, centre-crop ``size``, ImageNet mean and std)."""
        default = cls(size, size, round(size / 0.875))
        path = directory / "preprocessor_config.json" if directory is not None else None
        if path is None or not path.is_file():
            return default
        try:
            cfg: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise SourceError(f"{path}: not readable JSON: {e}") from None
        crop = cfg.get("crop_size") or {}
        height = int(crop.get("height", size)) if isinstance(crop, dict) else int(crop)
        width = int(crop.get("width", size)) if isinstance(crop, dict) else int(crop)
        resize = cfg.get("size") or {}
        if isinstance(resize, dict):
            shortest = int(resize.get("shortest_edge") or resize.get("height") or height)
        else:
            shortest = int(resize)
        if cfg.get("crop_pct"):
            shortest = round(shortest / float(cfg["crop_pct"]))
        mean = tuple(float(v) for v in cfg.get("image_mean", IMAGENET_MEAN))
        std = tuple(float(v) for v in cfg.get("image_std", IMAGENET_STD))
        if len(mean) != 3 or len(std) != 3:
            raise SourceError(f"{path}: image_mean and image_std must have 3 values (RGB)")
        rescale = float(cfg.get("rescale_factor", 1 / 255)) if cfg.get("do_rescale", True) else 1.0
        return cls(height, width, shortest, (mean[0], mean[1], mean[2]), (std[0], std[1], std[2]), rescale)


@dataclass(frozen=True, slots=True)
class Preprocessing:
    """A source's pre-processing: a tokenizer (text models) or an image recipe (image models), or neither."""

    tokenizer: Path | None = None
    """A folder holding ``tokenizer.json`` (or a ``tokenizer.json`` file)."""
    max_text_length: int = DEFAULT_MAX_TEXT_LENGTH
    image: ImagePreprocessing | None = None

    def parameters(self) -> dict[str, str]:
        """The config parameters that describe it."""
        params = self.image.parameters() if self.image is not None else {}
        if self.tokenizer is not None:
            params[PARAM_TOKENIZER] = TOKENIZER_FILE
            params[PARAM_MAX_LENGTH] = str(self.max_text_length)
        return params


def tokenizer_file(source: Path) -> Path:
    """``source``'s ``tokenizer.json``; :class:`SourceError` naming what is missing otherwise."""
    path = source / TOKENIZER_FILE if source.is_dir() else source
    if path.name != TOKENIZER_FILE or not path.is_file():
        raise SourceError(
            f"no tokenizer at {source}: expected {TOKENIZER_FILE} (a Hugging Face fast tokenizer file) "
            "or a folder holding it"
        )
    return path


def write_tokenizer(source: Path, dst: Path, max_length: int) -> None:
    """Write ``source``'s tokenizer into the version folder ``dst``, padded and truncated to ``max_length``.

    The companion files Hugging Face's ``AutoTokenizer`` reads (``tokenizer_config.json``,
    ``special_tokens_map.json``, ``vocab.txt``) are copied along when the source has them.
    """
    from tokenizers import Tokenizer

    path = tokenizer_file(source)
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:
        raise SourceError(f"{path}: not a tokenizers file: {e}") from None
    padding = tokenizer.padding or {}
    pad_id = int(padding.get("pad_id", tokenizer.token_to_id("[PAD]") or 0))
    tokenizer.enable_padding(
        length=max_length,
        pad_id=pad_id,
        pad_token=str(padding.get("pad_token", tokenizer.id_to_token(pad_id) or "[PAD]")),
        pad_type_id=int(padding.get("pad_type_id", 0)),
    )
    tokenizer.enable_truncation(max_length)
    tokenizer.save(str(dst / TOKENIZER_FILE))
    for name in COMPANION_FILES:
        if (path.parent / name).is_file():
            shutil.copyfile(path.parent / name, dst / name)
