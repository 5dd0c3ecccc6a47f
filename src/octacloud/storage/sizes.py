"""Sizes as people write them: ``20GiB``, ``500M``, ``1.5TB``, or a plain number of bytes."""

from __future__ import annotations

import re

from octacloud.core.errors import InvalidSpecError

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*$", re.IGNORECASE)


def parse_size(text: str, what: str = "--model-cache-size") -> int:
    """Bytes in ``text`` (decimal K/M/G/T, binary Ki/Mi/Gi/Ti, an optional B); at least 1."""
    m = _SIZE.match(text)
    if m is None:
        raise InvalidSpecError(f"{what}: {text!r} is not a size (e.g. 20GiB, 500MB, 1073741824)")
    value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if value < 1:
        raise InvalidSpecError(f"{what}: {text!r} is not a size of at least one byte")
    return value
