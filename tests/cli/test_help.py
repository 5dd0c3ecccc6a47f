"""Every command, option and argument of the CLI says what it is for (``--help`` is the first manual)."""

from __future__ import annotations

from typing import Any

import typer

from octacloud.cli.main import app


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
