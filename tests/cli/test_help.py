"""Every command, option and argument of the CLI says what it is for (``--help`` is the first manual)."""

from __future__ import annotations

from typing import Any

import typer
from typer.testing import CliRunner

from octacloud.cli.main import PANELS, app, command_name


def _commands(group: Any, prefix: str = "octacloud") -> list[tuple[str, Any]]:
    found = [(prefix, group)]
    if hasattr(group, "commands"):
        for name, command in sorted(group.commands.items()):
            found.extend(_commands(command, f"{prefix} {name}"))
    return found


def test_every_option_and_argument_has_help() -> None:
    missing = []
    for where, command in _commands(typer.main.get_command(app)):
        if where != "octacloud" and not (command.help or command.short_help):
            missing.append(f"{where}: the command")
        for param in command.params:
            if param.name == "help":
                continue
            if not (getattr(param, "help", None) or "").strip():
                missing.append(f"{where}: {param.opts[-1] if param.opts else param.name}")
    assert not missing, "no help text:\n" + "\n".join(missing)


def test_no_command_declares_an_option_twice() -> None:
    """Two options of one command answering to the same flag: click lets the later one win, so the other can
    only be reached by its other name (``tenant create --key K`` took K as the API key, and ``--key`` alone as
    "create a key" could not be said)."""
    clashes = []
    for where, command in _commands(typer.main.get_command(app)):
        seen: dict[str, str] = {}
        for param in command.params:
            for flag in (*param.opts, *getattr(param, "secondary_opts", ())):
                if flag in seen and seen[flag] != param.name:
                    clashes.append(f"{where}: {flag} is both {seen[flag]!r} and {param.name!r}")
                seen.setdefault(flag, str(param.name))
    assert not clashes, "\n".join(clashes)


def test_the_top_level_help_groups_every_command() -> None:
    out = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "160"}).output
    for panel in PANELS:
        assert f"─ {panel} ─" in out, out
    assert "─ Commands ─" not in out  # nothing left outside a group
    listed = {command_name(info) for info in [*app.registered_commands, *app.registered_groups]}
    assert listed == {name for names in PANELS.values() for name in names}


def test_flags_show_no_type() -> None:
    """A flag takes no value: ``--publish/--no-publish`` and ``--help`` carry no ``<bool>`` tag."""
    for args in (["--help"], ["deploy", "--help"], ["up", "--help"]):
        out = CliRunner().invoke(app, args, env={"COLUMNS": "160"}).output
        assert "<bool>" not in out, out
    out = CliRunner().invoke(app, ["deploy", "--help"], env={"COLUMNS": "160"}).output
    assert "--publish" in out and "<int>" in out  # options that take a value still say which
