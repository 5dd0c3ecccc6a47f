"""The user-facing docs' samples, run as printed against one cloud started as ``make up`` starts it.

Every shell command of docs/cloud.md, tenants.md, toolchain.md, storage.md, monitoring.md and llm.md (what
tests/test_docs.py's ``commands`` finds: the lines of a ```sh block, the ``$`` lines of a console or untagged
block) and every ```python block runs, in the order of the doc and the docs in that order, in the folder of a
cloud started with the Makefile's ``UP_ARGS`` on the example repository, with ``.venv/bin`` as ``make up`` leaves
it and ``$OCTACLOUD_KEY`` exported as the README's quick start does. One bash per command; what a command
exports is kept for the next; a Python sample runs once the deployments it names are ready (as a reader waits
for ``status`` to say so). A command must exit 0, unless the doc prints its output and that output is an
``error:``: then it must fail with that message. A table or CSV the doc prints must have the columns the command
prints.

A sample the test cannot run (it starts the cloud itself, a second cloud, or needs a store or files of the
reader's own) is in ``NOT_RUN`` with the reason, so a new sample runs by default; a value the reader copies from
one command's output into a later one is in ``COPIED``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from octacloud.serving.errors import ModelConfigError
from octacloud.serving.generate.engine import find_llama_server

from ..test_docs import commands
from .test_quickstart import Up, checkout, kill_replicas, make_up_args, port_free, start_up, wait_until

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "models"
"""Where `make models` builds the example repository (what `make test` runs on); OCTACLOUD_MODELS overrides it."""
DOCS = ("docs/cloud.md", "docs/tenants.md", "docs/toolchain.md", "docs/storage.md", "docs/monitoring.md", "docs/llm.md")
MODELS = ("mlp", "minilm", "mlp_fp16", "bert_base")  # what the samples name

# (doc, a pattern of the command as printed, why it is not run here)
NOT_RUN = (
    ("docs/cloud.md", r"^make up\b", "starts the cloud: this test starts it as `make up` does"),
    ("docs/tenants.md", r"^\.venv/bin/octacloud up \.\.\.", "starts the cloud: this test starts it as `make up` does"),
    ("docs/tenants.md", r"^\.venv/bin/octacloud up --tls-cert ", "a second cloud on the same ports and state dir: "
     "tests/security/test_tls.py serves both protocols over TLS"),
    ("docs/tenants.md", r"^export OCTACLOUD_URL=https:", "points the CLI at the TLS cloud of the line before"),
    ("docs/toolchain.md", r"^\.venv/bin/octacloud convert ", "converts the reader's own model files (the paths are "
     "examples): tests/toolchain/test_cli.py converts each kind of source"),
    ("docs/llm.md", r"^make (models|up)\b", "builds the repository and starts the cloud: this test starts it as "
     "`make up` does on the built repository"),
    ("docs/monitoring.md", r"^\.venv/bin/octacloud top (?!.*--once)", "redraws until Ctrl-C: its --once frame is run"),
    ("docs/storage.md", r"^export AWS_", "the credentials of the reader's S3 endpoint"),
    ("docs/storage.md", r"s3://", "needs an S3-compatible store: tests/storage/test_cli_store.py runs convert "
     "--publish, models publish and models list --storage against SeaweedFS"),
)  # fmt: skip

PRICED = ("cost",)  # a column only a cloud with a price sheet prints (`up --prices`; `make up` has none)

# (doc, the command that prints the value, its pattern in the output, what the later samples write in its place)
COPIED = (
    ("docs/tenants.md", r"tenant create globex", r"^\s*(oc_\S+)$", "$GLOBEX"),
    ("docs/tenants.md", r"key create --tenant acme", r"^key (\w+) for", "4bc2d8982cdc"),
)


@dataclass
class Sample:
    doc: str
    line: int
    command: str
    printed: list[str] = field(default_factory=list)  # the output the doc shows under it

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.command}"

    def reason_not_run(self) -> str | None:
        reasons = (why for doc, pattern, why in NOT_RUN if doc == self.doc and re.search(pattern, self.command))
        return next(reasons, None)

    def printed_error(self) -> str | None:
        """The error the doc prints under the command, up to where it elides (``...``), in single spaces."""
        if not self.printed or not self.printed[0].startswith("error:"):
            return None
        text = " ".join(" ".join(self.printed).split())
        return re.split(r"\(\.\.\.\)|\.\.\.|…", text)[0].strip()


def header(lines: list[str]) -> list[str] | None:
    """The column names of the first table (rich's ``┃ a ┃ b ┃`` row) or CSV header (``a,b``) in ``lines``."""
    for line in lines:
        if line.startswith("┃"):
            return [name.strip() for name in line.strip("┃").split("┃")]
        if re.fullmatch(r"[a-z_]+(,[a-z_]+)+", line):
            return line.split(",")
    return None


def shell_samples(doc: str) -> list[Sample]:
    lines = (ROOT / doc).read_text().splitlines()
    found = []
    for number, command in commands(ROOT / doc):
        sample = Sample(doc, number, command)
        at = number
        while sample.command.endswith("\\") and at < len(lines):  # a command continued on the next lines
            sample.command = sample.command[:-1] + " " + lines[at].strip()
            at += 1
        if lines[number - 1].lstrip().startswith("$ "):
            for text in lines[at:]:
                if text.startswith("```") or text.lstrip().startswith("$ "):
                    break
                sample.printed.append(text.strip())
        found.append(sample)
    return found


def python_samples(doc: str) -> list[Sample]:
    text = (ROOT / doc).read_text()
    return [
        Sample(doc, text[: m.start()].count("\n") + 2, m.group(1))
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)
    ]


def test_every_sample_not_run_is_still_in_the_docs() -> None:
    everything = [s for doc in DOCS for s in shell_samples(doc)]
    stale = [(d, p) for d, p, _ in NOT_RUN if not any(s.doc == d and re.search(p, s.command) for s in everything)]
    stale += [(d, c) for d, c, _, _ in COPIED if not any(s.doc == d and re.search(c, s.command) for s in everything)]
    assert not stale, f"NOT_RUN or COPIED name samples the docs no longer have: {stale}"


def test_an_error_the_doc_prints_is_read_up_to_its_ellipsis() -> None:
    sample = Sample("d", 1, "x", ["error: deployment 'mlp': 60 replica(s) can", "never be placed: at most 51 (...)"])
    assert sample.printed_error() == "error: deployment 'mlp': 60 replica(s) can never be placed: at most 51"
    assert Sample("d", 1, "x", ["deployed mlp: error: no"]).printed_error() is None


def test_the_columns_the_doc_prints_are_read_from_a_table_or_a_csv_header() -> None:
    assert header(["usage by deployment", "┏━━━┳━━━┓", "┃ tenant ┃   cost ┃", "│ acme │ 1 │"]) == ["tenant", "cost"]
    assert header(["tenant,group,cost", "acme,2026-11-30,0.1"]) == ["tenant", "group", "cost"]
    assert header(["deployed mlp: 1 replica(s)", "  keeps version latest, octants auto (1)"]) is None


@dataclass
class Shell:
    """The reader's shell: one bash per command in ``work``, the environment carried from one to the next."""

    work: Path
    env: dict[str, str]

    def run(self, command: str) -> tuple[int, str]:
        saved = self.work / ".sample-env"
        script = f'{command}\n__rc=$?\nenv -0 > {shlex.quote(str(saved))}\nexit "$__rc"\n'
        done = subprocess.run(["bash", "-c", script], cwd=self.work, env=self.env, capture_output=True, text=True,
                              timeout=240)  # fmt: skip
        if saved.exists():
            self.env = dict(item.split("=", 1) for item in saved.read_text().split("\0") if "=" in item)
            saved.unlink()
        return done.returncode, done.stdout + done.stderr


@dataclass
class Cloud:
    up: Up
    shell: Shell
    copied: dict[str, str] = field(default_factory=dict)  # what a sample writes → what the reader copied


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cloud]:
    if not (port_free(8000) and port_free(8001)):
        pytest.skip("ports 8000/8001 are taken: the docs talk to the default ports (run in scripts/netns-run)")
    examples = os.environ.get("OCTACLOUD_MODELS", str(EXAMPLES))
    if not examples or not all((Path(examples) / m / "config.pbtxt").is_file() for m in MODELS):
        pytest.skip(f"the docs' samples name the example models {MODELS}: run `make models` (or set OCTACLOUD_MODELS)")
    work = checkout(tmp_path_factory.mktemp("docs") / "octacloud")
    (work / "models").symlink_to(examples, target_is_directory=True)  # `make up` builds them in models/
    env = {k: v for k, v in os.environ.items() if not k.startswith("OCTACLOUD_") or k == "OCTACLOUD_TRACES"}
    env["COLUMNS"] = "200"
    up_args = make_up_args()
    up = start_up(work, Path(examples), up_args, env)
    try:
        for name in [up_args[i + 1] for i, a in enumerate(up_args) if a == "--deploy"]:
            wait_until(f"{name} ready", lambda name=name: len(up.ready(name)) == 1, timeout=240)
        yield Cloud(up, Shell(work, {**env, "OCTACLOUD_KEY": up.key}))  # the README's `export OCTACLOUD_KEY=...`
    finally:
        up.stop()
        subprocess.run([str(work / ".venv/bin/octacloud"), "down"], cwd=work, env=env, capture_output=True, timeout=120)
        kill_replicas(work)


def run_sample(cloud: Cloud, sample: Sample) -> str | None:
    """What was wrong with the sample as printed, or None."""
    command = sample.command
    for written, value in cloud.copied.items():
        command = command.replace(written, value)
    code, out = cloud.shell.run(command)
    for doc, pattern, value, written in COPIED:
        if doc == sample.doc and re.search(pattern, sample.command) and code == 0:
            found = re.search(value, out, re.M)
            assert found is not None, f"{sample}: no {value!r} in what it printed:\n{out}"
            cloud.copied[written] = found.group(1)
    expected = sample.printed_error()
    if expected is None and code != 0:
        return f"{sample}\n  exited {code}:\n{out}"
    columns = header(sample.printed)
    printed = header([line.strip() for line in out.splitlines()])
    if columns is not None and [c for c in columns if c not in PRICED] != [c for c in printed or [] if c not in PRICED]:
        return f"{sample}\n  the doc prints the columns {columns}; it printed:\n{out}"
    if expected is not None and (code == 0 or expected not in " ".join(out.split())):
        return f"{sample}\n  the doc prints {expected!r}; it exited {code} with:\n{out}"
    return None


def needs_the_engine() -> None:
    if not (Path(os.environ.get("OCTACLOUD_MODELS", str(EXAMPLES))) / "smollm2" / "config.pbtxt").is_file():
        pytest.skip("docs/llm.md deploys smollm2, which is not built: run `make models`")
    try:
        find_llama_server()
    except ModelConfigError as exc:
        pytest.skip(str(exc))


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS)
def test_the_samples_of_a_doc_run_as_printed(cloud: Cloud, doc: str) -> None:
    if doc == "docs/llm.md":
        needs_the_engine()
    failed = []
    for sample in shell_samples(doc):
        if sample.reason_not_run() is None:
            failed.append(run_sample(cloud, sample))
    for sample in python_samples(doc):
        for name in re.findall(r'(?:model=|infer\()"(\w+)"', sample.command):  # the reader waits for `status`
            wait_until(f"{name} ready", lambda name=name: bool(cloud.up.ready(name)), timeout=240)
        code, out = cloud.shell.run(f".venv/bin/python -c {shlex.quote(sample.command)}")
        failed.append(f"{sample.doc}:{sample.line} (python)\n  exited {code}:\n{out}" if code else None)
    problems = [f for f in failed if f is not None]
    assert not problems, "samples that fail as printed:\n" + "\n".join(problems)
