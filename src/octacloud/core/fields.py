"""Checks of the fields users send (REST bodies, CLI options, stored records), by type and range.

JSON hands a server floats, NaN, Infinity, booleans and integers of any size where an integer is meant, and a
name may end in a newline that a ``$``-anchored pattern lets through. Each check takes the raw value and returns
it typed, or raises :class:`InvalidSpecError` naming the field, what it got (shortened, as JSON spells it) and
what it needs. Booleans are never numbers here, integers are never floats, numbers are finite, and names match
their pattern in full.
"""

from __future__ import annotations

import math
import re

from octacloud.core.errors import InvalidSpecError

_SHOWN = 64
"""At most this many characters of a rejected value appear in a message."""

TENANT_NAME = re.compile(r"[a-z0-9]([a-z0-9_-]{0,30}[a-z0-9])?")
TENANT_RULE = "1-32 lowercase letters, digits, '-' or '_', starting and ending with a letter or digit"
CLASS_NAME = TENANT_NAME
"""A priority class's name: the same rule as a tenant's."""
CLASS_RULE = TENANT_RULE
PRIORITY_RANGE = (-1_000_000, 1_000_000)
"""The scheduling priorities a deployment or a priority class may have."""


def shown(value: object) -> str:
    """``value`` as JSON would spell it, shortened: what an error message quotes of the input."""
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, float) and not math.isfinite(value):
        text = "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    elif isinstance(value, int) and abs(value) >= 10**18:
        text = f"{'-' if value < 0 else ''}a {len(str(abs(value)))}-digit number"
    else:
        text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def whole(value: object, what: str, low: int, high: int) -> int:
    """An integer in ``low..high`` (not a bool, not a float, not even 2.0)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidSpecError(f"{what} must be a whole number in {low}..{high}, got {shown(value)}")
    return value


def number(value: object, what: str, high: float, *, low: float = 0.0, above_low: bool = True) -> float:
    """A finite number (an integer or a float, not a bool) above ``low`` (or at least ``low`` when not
    ``above_low``) and at most ``high``."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok:
        x = float(value)  # type: ignore[arg-type]
        ok = math.isfinite(x) and (x > low if above_low else x >= low) and x <= high
    if not ok:
        bound = f"> {low:g}" if above_low else f">= {low:g}"
        raise InvalidSpecError(f"{what} must be {bound}, finite and <= {high:g}, got {shown(value)}")
    return float(value)  # type: ignore[arg-type]


def flag(value: object, what: str) -> bool:
    """``true`` or ``false`` (not 0, 1 or a string)."""
    if not isinstance(value, bool):
        raise InvalidSpecError(f"{what} must be true or false, got {shown(value)}")
    return value


def name(value: object, what: str, pattern: re.Pattern[str], rule: str) -> str:
    """A string that ``pattern`` matches in full (a trailing newline or a control character never passes)."""
    if not isinstance(value, str) or pattern.fullmatch(value) is None:
        raise InvalidSpecError(f"{what} {shown(value)} must be {rule}")
    return value


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def text(value: object, what: str, max_length: int) -> str:
    """Free text of at most ``max_length`` characters, without control characters (no newline, no NUL)."""
    if not isinstance(value, str) or len(value) > max_length or _CONTROL.search(value):
        raise InvalidSpecError(
            f"{what} must be text of at most {max_length} characters without control characters, got {shown(value)}"
        )
    return value
