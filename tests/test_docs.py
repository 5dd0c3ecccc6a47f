"""The documentation stays a set of references a user can follow: every doc is reachable from the README's
documentation list, every relative link (and its #anchor) leads somewhere, and no doc outgrows a reference."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINKED = [ROOT / "README.md", *DOCS, *sorted((ROOT / "bench" / "results").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MAX_LINES = 500


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces to hyphens."""
    found = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # links in code blocks are not links
    return [m.group(1) for m in LINK.finditer(text)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_a_doc_is_a_reference_not_a_record(doc: Path) -> None:
    lines = len(doc.read_text().splitlines())
    assert lines <= MAX_LINES, f"{doc.name} has {lines} lines: move measured history to bench/results/"


def test_the_readme_leads_to_every_doc() -> None:
    readme = set(links(ROOT / "README.md"))
    missing = [d.name for d in DOCS if f"docs/{d.name}" not in readme]
    assert not missing, f"README.md's documentation list does not link {missing}"


@pytest.mark.parametrize("source", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_somewhere(source: Path) -> None:
    broken = []
    for target in links(source):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        path = (source.parent / file).resolve() if file else source
        if not path.exists() or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
            broken.append(target)
    assert not broken, f"{source.relative_to(ROOT)}: links that lead nowhere: {broken}"


SHELL_BLOCKS = {"sh", "bash", "shell", "console"}
# after any VAR=value the command sets, and inside the test sandbox
BARE = re.compile(r"(\w+=\S*\s+)*(scripts/netns-run\s+)?(octacloud|python3?)(\s|$)")


def commands(path: Path) -> list[tuple[int, str]]:
    """The command lines of a Markdown file's shell samples, with their line numbers: in a ```sh or ```bash
    block every line that is not a comment or a continuation, in a ```console block (or an untagged one) the
    lines after a ``$`` prompt."""
    found = []
    tag: str | None = None
    continued = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            tag = line[3:].strip() if tag is None else None
            continued = False
            continue
        text = line.strip()
        if tag is not None and text.startswith("$ ") and tag in {*SHELL_BLOCKS, ""}:
            found.append((number, text[2:].lstrip()))
        elif tag in SHELL_BLOCKS - {"console"} and text and not text.startswith("#") and not continued:
            found.append((number, text))
        continued = tag is not None and line.rstrip().endswith("\\")
    return found


def bare_commands(path: Path) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{n}: {cmd}" for n, cmd in commands(path) if BARE.match(cmd)]


@pytest.mark.parametrize("doc", [ROOT / "README.md", *DOCS], ids=lambda p: p.name)
def test_shell_samples_run_as_printed_from_the_checkout(doc: Path) -> None:
    bare = bare_commands(doc)
    assert not bare, (
        "`make up` puts octacloud and its Python in .venv/bin, not on PATH: write .venv/bin/octacloud and "
        f".venv/bin/python in {bare}"
    )


def test_a_bare_command_in_a_shell_sample_is_caught(tmp_path: Path) -> None:
    sample = tmp_path / "sample.md"
    sample.write_text(
        "```sh\n.venv/bin/octacloud up --repository models \\\n    octacloud-is-an-argument\n"
        "# octacloud in a comment is prose\noctacloud status\n```\n"
        "```console\n$ python3 -c 'print(1)'\noctacloud is up: output, not a command\n$ .venv/bin/python x.py\n"
        "$ OCTACLOUD_KEY=$OTHER octacloud usage\n$ scripts/netns-run python bench/x.py\n```\n"
        "```\n$ octacloud deploy mlp\n```\n"
        "```yaml\noctacloud: a key\n```\n"
    )
    found = [(n, cmd) for n, cmd in commands(sample) if BARE.match(cmd)]
    assert found == [
        (5, "octacloud status"),
        (8, "python3 -c 'print(1)'"),
        (11, "OCTACLOUD_KEY=$OTHER octacloud usage"),
        (12, "scripts/netns-run python bench/x.py"),
        (15, "octacloud deploy mlp"),
    ]
