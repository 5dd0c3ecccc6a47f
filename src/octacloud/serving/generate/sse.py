"""Server-sent events as OpenAI streams them: ``data: <json>`` events ended by a blank line, ``data: [DONE]`` last.

:class:`EventSplitter` cuts a byte stream (chunks of any size, as the network delivers them) into whole events,
so that each hop relays events, never half of one; :func:`data_of` reads an event's JSON.
"""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"
MAX_EVENT_BYTES = 8 * 2**20
"""An event larger than this is a broken stream, not a token."""


class EventSplitter:
    """Feed bytes, get whole events (each with its blank line). Accepts ``\\n\\n`` and ``\\r\\n\\r\\n`` ends."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._pending + data if self._pending else data
        events = []
        start = 0
        while True:
            end = buffer.find(b"\n\n", start)
            crlf = buffer.find(b"\r\n\r\n", start)
            if crlf != -1 and (end == -1 or crlf < end):
                end, size = crlf, 4
            else:
                size = 2
            if end == -1:
                break
            events.append(buffer[start : end + size])
            start = end + size
        self._pending = buffer[start:]
        if len(self._pending) > MAX_EVENT_BYTES:
            raise ValueError(f"a stream event is over {MAX_EVENT_BYTES} bytes")
        return events

    @property
    def rest(self) -> bytes:
        """Bytes after the last whole event (a stream that ended there was cut)."""
        return self._pending


def data_of(event: bytes) -> Any:
    """The JSON of a ``data:`` event; ``None`` for ``[DONE]``, comments and events without data."""
    lines = [line[5:].lstrip() for line in event.splitlines() if line.startswith(b"data:")]
    if not lines:
        return None
    payload = b"\n".join(lines)
    if payload == b"[DONE]":
        return None
    try:
        return json.loads(payload)
    except ValueError:
        return None


def event(payload: object) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
