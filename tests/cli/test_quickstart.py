"""The README's quick start, run verbatim against a cloud started as ``make up`` starts it.

The cloud is ``octacloud up --repository REPO $(UP_ARGS)`` with the Makefile's own ``UP_ARGS``, in a fresh
folder (its ``var/`` state dir, the default ports 8000/8001, the demo fleet of a host without GPUs), with
``.venv/bin/octacloud`` in that folder running this checkout. REPO is the example repository
(``models/`` as ``make models`` builds it, or ``$OCTACLOUD_MODELS``) when it holds every model the quick start
names, else a repository of tiny models under
those names. The ```sh block of README.md that runs ``octacloud status`` is run line by line in one bash, and
each command's effect is checked. Then: the request ``up`` printed is pasted; ``up`` is restarted and leaves
the operator's scaling alone; ``down`` refuses while ``up`` runs and stops every replica once it has stopped.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from octacloud.control.launcher import _pid_alive
from octacloud.control.store import StateStore

from ..cluster.conftest import write_linear_model

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "models"
"""Where `make models` builds the example repository (what `make test` runs on); OCTACLOUD_MODELS overrides it."""
URL = "http://127.0.0.1:8000"


def quickstart_block() -> list[str]:
    """The command lines of README.md's quick start (the ```sh block that runs ``octacloud status``)."""
    blocks = re.findall(r"^```sh\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)
    block = next(b for b in blocks if "octacloud status" in b)
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def make_up_args() -> list[str]:
    """The arguments ``make up`` gives ``octacloud up`` after ``--repository``: the Makefile's UP_ARGS."""
    makefile = (ROOT / "Makefile").read_text()
    assert "$(BIN)/octacloud up --repository $(MODELS) $(UP_ARGS)" in makefile  # what this test reproduces
    match = re.search(r"^UP_ARGS \?= (.*)$", makefile, re.M)
    assert match is not None
    return shlex.split(match.group(1))


def models_named(up_args: list[str], lines: list[str]) -> list[str]:
    deployed = [up_args[i + 1] for i, a in enumerate(up_args) if a == "--deploy"]
    for line in lines:
        words = shlex.split(line, comments=True)
        if len(words) > 2 and words[0].endswith("octacloud") and words[1] == "deploy":
            deployed.append(words[2])
    return deployed


def repository(tmp: Path, models: list[str]) -> Path:
    examples = os.environ.get("OCTACLOUD_MODELS", str(EXAMPLES))
    if examples and all((Path(examples) / m / "config.pbtxt").is_file() for m in models):
        return Path(examples)
    for m in models:
        write_linear_model(tmp / "models", m)
    return tmp / "models"


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class Up:
    """``octacloud up`` running in ``work`` (its output in ``log``)."""

    work: Path
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def key(self) -> str:
        return (self.work / "var" / "admin.key").read_text().strip()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def deployments(self) -> dict[str, Any]:
        response = httpx.get(f"{URL}/admin/deployments", headers={"Authorization": f"Bearer {self.key}"}, timeout=10)
        assert response.status_code == 200, response.text
        return {d["spec"]["name"]: d for d in response.json()["deployments"]}

    def ready(self, name: str) -> list[dict[str, Any]]:
        d = self.deployments().get(name)
        return [] if d is None else [r for r in d["instances"] if r["state"] == "ready"]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)


def start_up(work: Path, repo: Path, args: list[str], env: dict[str, str]) -> Up:
    log = work / f"up-{time.monotonic_ns()}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(work / ".venv/bin/octacloud"), "up", "--repository", str(repo), *args],
            cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    up = Up(work, process, log)
    wait_until("up to print its banner", lambda: "octacloud is up" in up.output() or process.poll() is not None)
    assert process.poll() is None, up.output()
    return up


def wait_until(what: str, predicate: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def run_block(lines: list[str], work: Path, env: dict[str, str]) -> list[tuple[str, int, str]]:
    """Each line in one bash, in order: (line, exit status, what it printed)."""
    script = "".join(f'{line}\necho "@@quickstart-rc=$?"\n' for line in lines)
    done = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=240)
    parts = re.split(r"^@@quickstart-rc=(\d+)\n", done.stdout, flags=re.M)
    outputs, codes = parts[0::2], [int(c) for c in parts[1::2]]
    assert len(codes) == len(lines), done.stdout + done.stderr
    return [(line, code, out) for line, code, out in zip(lines, codes, outputs, strict=False)]


def examples_repository() -> Path | None:
    examples = os.environ.get("OCTACLOUD_MODELS", str(EXAMPLES))
    return Path(examples) if examples else None


def python_blocks(doc: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", doc.read_text(), re.S | re.M)


def usage_lines(example: Path) -> list[str]:
    """The command lines an example's docstring shows (those that need no file of the user's)."""
    lines = [line.strip() for line in (example.read_text().split('"""')[1]).splitlines()]
    return [
        line.split("  #")[0].strip() for line in lines if line.startswith(".venv/bin/python ") and "photo" not in line
    ]


def run_documented_samples(work: Path, env: dict[str, str]) -> None:
    """The README's Python sample, docs/toolchain.md's MiniLM sample and the examples' usage lines, as printed,
    against the cloud the quick start left running (mlp, minilm, resnet50_int8 deployed)."""
    readme = python_blocks(ROOT / "README.md")[0]
    minilm = next(b for b in python_blocks(ROOT / "docs" / "toolchain.md") if '"minilm"' in b)
    for where, code, expected in (("README.md", readme, "[["), ("docs/toolchain.md", minilm, "")):
        done = subprocess.run([".venv/bin/python", "-c", code], cwd=work, env=env, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert done.returncode == 0 and expected in done.stdout, f"{where}'s sample:\n{done.stdout}{done.stderr}"
    for example in sorted((ROOT / "examples").glob("*.py")):
        for line in usage_lines(example):
            done = subprocess.run(["bash", "-c", line], cwd=work, env=env, capture_output=True, text=True,
                                  timeout=120)  # fmt: skip
            assert done.returncode == 0, f"{example.name}: {line!r}:\n{done.stdout}{done.stderr}"


def roll_out_and_scale(up: Up, work: Path, env: dict[str, str]) -> None:
    """What a newcomer does next: rolls out a new version by deploying it under the same name (the 2 replicas the
    quick start's ``scale mlp 2`` asked for are kept, and the command says so), and scales a model that ``deploy``
    started (``resnet50_int8``) as one that ``up`` started."""

    def octacloud(*args: str) -> str:
        done = subprocess.run([".venv/bin/octacloud", *args], cwd=work, env=env, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert done.returncode == 0, f"octacloud {' '.join(args)} failed:\n{done.stdout}{done.stderr}"
        return done.stdout

    old = {r["id"] for r in up.deployments()["mlp"]["instances"]}
    assert len(old) == 2
    out = octacloud("deploy", "mlp_fp16", "--name", "mlp")
    assert "keeps " in out and "2 replica(s)" in out and "changes model mlp → mlp_fp16" in out, out

    def rolled() -> bool:
        d = up.deployments()["mlp"]
        ids = {r["id"] for r in d["instances"]}
        return d["spec"]["model"] == "mlp_fp16" and len(up.ready("mlp")) == 2 == len(ids) and not ids & old

    wait_until("mlp rolled out to mlp_fp16 with its 2 replicas", rolled, timeout=240)
    out = octacloud("scale", "resnet50_int8", "2")
    assert "resnet50_int8: 2 replica(s)" in out, out
    wait_until("2 replicas of resnet50_int8", lambda: len(up.ready("resnet50_int8")) == 2, timeout=240)


def checkout(work: Path) -> Path:
    """A folder laid out as a checkout after ``make up``: ``.venv/bin/octacloud`` and ``.venv/bin/python`` running
    this checkout with this interpreter, and ``examples/``."""
    (work / ".venv" / "bin").mkdir(parents=True)
    wrapper = work / ".venv" / "bin" / "octacloud"
    wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m octacloud "$@"\n')
    wrapper.chmod(0o755)
    python = work / ".venv" / "bin" / "python"  # the checkout's interpreter, as `make up` leaves it
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    python.chmod(0o755)
    (work / "examples").symlink_to(ROOT / "examples")
    return work


def kill_replicas(work: Path) -> None:
    """Kill whatever replica processes the cloud in ``work`` left running (a failed test's)."""
    db = work / "var" / "octacloud.db"
    if db.exists():  # whatever a failed test left running
        store = StateStore.at(db)
        for r in store.replicas():
            if r.handle.isdigit() and _pid_alive(int(r.handle)):
                os.kill(int(r.handle), signal.SIGKILL)
        store.close()


@pytest.fixture
def work(tmp_path: Path) -> Iterator[Path]:
    if not (port_free(8000) and port_free(8001)):
        pytest.skip("ports 8000/8001 are taken: the quick start talks to the default ports (run in scripts/netns-run)")
    yield checkout(tmp_path / "octacloud")
    kill_replicas(tmp_path / "octacloud")


def test_the_readme_quick_start_runs_as_printed(work: Path, tmp_path: Path) -> None:
    lines = quickstart_block()
    up_args = make_up_args()
    repo = repository(tmp_path, models_named(up_args, lines))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OCTACLOUD_") or k == "OCTACLOUD_TRACES"}
    env["COLUMNS"] = "200"
    up = start_up(work, repo, up_args, env)
    try:
        banner = up.output()
        assert "a demo fleet carved out of" in banner and "demo-a" in banner and "demo-b" in banner
        assert f"dashboard {URL}/dashboard/" in banner
        assert httpx.get(f"{URL}/dashboard/", timeout=10).status_code == 200  # the address printed is the page
        initial = [up_args[i + 1] for i, a in enumerate(up_args) if a == "--deploy"]
        for name in initial:
            wait_until(f"{name} ready", lambda name=name: len(up.ready(name)) == 1)

        if not (work / "models").exists():  # `make up` builds the repository in the checkout's models/
            (work / "models").symlink_to(repo, target_is_directory=True)
        for line, code, out in run_block(lines, work, env):
            assert code == 0, f"{line!r} failed ({code}):\n{out}"
            words = shlex.split(line, comments=True)
            command = words[1] if words[0].endswith("octacloud") else words[0]
            if command == "status":
                for name in initial:
                    assert re.search(rf"│ {re.escape(name)} .*│ ready ", out), out
            elif command == "deploy":
                name, octants = words[2], int(words[words.index("--octants") + 1])
                assert f"deployed {name}: 1 replica(s) × {octants} octant(s)" in out, out
                wait_until(f"{name} ready", lambda name=name: len(up.ready(name)) == 1)
                assert up.ready(name)[0]["milli_per_gpu"] == octants * 125
            elif command == "scale":
                name, n = words[2], int(words[3])
                assert f"{name}: {n} replica(s)" in out, out
                wait_until(f"{n} replicas of {name}", lambda name=name, n=n: len(up.ready(name)) == n)
            elif command == "events":
                assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d .*ready", out), out
            elif command == "usage":
                assert "usage by deployment" in out, out
            elif command == "top":
                assert "demo-a" in out and "demo-b" in out, out
            elif command == "models":
                assert all(name in out for name in initial), out
            else:
                assert command == "export", f"the quick start has a command this test does not check: {line!r}"

        # the request `up` printed works when pasted
        printed = up.output().splitlines()
        ask = next(i for i, text in enumerate(printed) if text.startswith("ask "))
        curl, python = printed[ask + 1].strip(), printed[ask + 2].strip()
        answer = subprocess.run(["bash", "-c", curl], cwd=work, env=env, capture_output=True, text=True, timeout=60)
        assert '"outputs"' in answer.stdout, answer.stdout + answer.stderr
        grpc = subprocess.run(["bash", "-c", python], cwd=work, env=env, capture_output=True, text=True, timeout=60)
        assert grpc.returncode == 0 and "array(" in grpc.stdout, grpc.stdout + grpc.stderr
        if repo == examples_repository():  # the samples below need the real example models
            run_documented_samples(work, {**env, "OCTACLOUD_KEY": up.key})
            roll_out_and_scale(up, work, {**env, "OCTACLOUD_KEY": up.key})

        # a second `up` on the same state refuses
        again = subprocess.run([str(work / ".venv/bin/octacloud"), "up", "--repository", str(repo), *up_args],
                               cwd=work, env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert again.returncode == 2 and "one cloud per state dir" in again.stderr, again.stdout + again.stderr

        # `down` refuses while `up` runs, and kills nothing
        before = {n: [r["pid"] for r in d["instances"]] for n, d in up.deployments().items()}
        refused = subprocess.run([str(work / ".venv/bin/octacloud"), "down"], cwd=work, env=env, capture_output=True,
                                 text=True, timeout=60)  # fmt: skip
        assert refused.returncode == 1 and "is running on var" in refused.stderr, refused.stdout + refused.stderr
        assert all(_pid_alive(pid) for pids in before.values() for pid in pids)

        # a restart (`make up` again) adopts the replicas and leaves the operator's scaling as it was
        up.stop()
        up = start_up(work, repo, up_args, env)
        wait_until("the replicas adopted", lambda: all(len(up.ready(n)) == len(p) for n, p in before.items()))
        after = {n: [r["pid"] for r in d["instances"]] for n, d in up.deployments().items()}
        assert after == before
        assert re.search(r"deployment mlp exists \(2 replica\(s\)\): left as it is", up.output()), up.output()
    finally:
        up.stop()

    # with `up` stopped, `down` stops every replica
    stopped = subprocess.run([str(work / ".venv/bin/octacloud"), "down"], cwd=work, env=env, capture_output=True,
                             text=True, timeout=120)  # fmt: skip
    total = sum(len(p) for p in before.values())
    assert stopped.returncode == 0 and f"stopped {total} replica(s)" in stopped.stdout, stopped.stdout + stopped.stderr
    assert not any(_pid_alive(pid) for pids in before.values() for pid in pids)
