"""The clients in examples/ run against the example repository served by ``octacloud serve``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serve_process import serve_process

pytestmark = [pytest.mark.models, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr + done.stdout
    return done.stdout


def test_the_example_clients_run(built_models: Path) -> None:
    models = ("--load-model", "minilm", "--load-model", "resnet50_int8")
    with serve_process(built_models, "--model-control-mode", "explicit", *models, metrics=False) as s:
        url = f"127.0.0.1:{s.http}"
        texts = ["A man is eating food.", "A man is eating a piece of bread.", "The new movie is awesome."]
        out = run_example("text_embeddings.py", "--url", url, *texts).splitlines()
        assert out[0] == "minilm: 3 text(s) -> sentence_embedding [3, 384]"
        similarity = [[float(v) for v in line.split()[:3]] for line in out[1:4]]
        assert all(abs(similarity[i][i] - 1) < 1e-3 for i in range(3))
        assert similarity[0][1] > 0.5 > similarity[0][2]  # MiniLM is trained: meaning shows
        out = run_example("image_classification.py", "--url", url, "--model", "resnet50_int8", "--synthetic")
        lines = out.splitlines()
        assert lines[0].startswith("resnet50_int8: top 5 of a synthetic image")
        assert len(lines) == 6 and all(re.fullmatch(r"-?\d+\.\d{6}:\d+", line) for line in lines[1:]), out
        scores = [float(line.split(":")[0]) for line in lines[1:]]
        assert scores == sorted(scores, reverse=True)
