"""What one client may cost octacloud's HTTP/2 server (``h2.py``) before its calls complete, and how many frames
that carry no call it may send: the server's answer to each published HTTP/2 attack class, each bound modelled
on a maintained server's (nghttp2, Go's ``x/net/http2``, Envoy). docs/security.md has the table: each limit, its
default in the gateway, the attack it answers and the server it follows. In short, per connection:

- a header block is bounded while it is read: its bytes as sent (HEADERS and CONTINUATION together) by the
  header list limit, its CONTINUATION frames by what that limit needs plus 8 (nghttp2), its time by
  ``header_timeout_s``; past any, GOAWAY (its HPACK state cannot be kept without decoding it);
- what calls hold before their message completes (their metadata, partial messages, streamed messages not yet
  taken) is bounded per connection and per owner (the caller, over all its connections), and the calls waiting
  for their message per owner; past a bound, that call is RESOURCE_EXHAUSTED and its stream reset;
- a call's message must arrive within ``message_timeout_s`` of its HEADERS (DEADLINE_EXCEEDED);
- a connection whose output is not taken (``max_queued_output`` queued) is not read until it drains, and one
  whose output does not move for ``stall_timeout_s`` (a full socket, a window of 0) is closed;
- PING, SETTINGS and RST_STREAM are token buckets on the loop's clock; WINDOW_UPDATE, PRIORITY and empty frames
  are counted against what the connection did (Envoy's formulas); past any, GOAWAY ENHANCE_YOUR_CALM.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

from octacloud.protocols.grpc.h2_frames import (
    CONTINUATION,
    DATA,
    DEFAULT_FRAME,
    END_STREAM,
    HEADERS,
    PING,
    PRIORITY,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
)


@dataclass(frozen=True, slots=True)
class Rate:
    burst: int
    per_s: float


@dataclass(frozen=True, slots=True)
class Http2Limits:
    """The bounds of the module's table that a server may set (None: not bounded)."""

    buffered_bytes_per_connection: int | None = None
    buffered_bytes_per_owner: int | None = None
    streams_per_owner: int | None = None
    message_timeout_s: float | None = None
    stall_timeout_s: float | None = None
    max_queued_output: int = 2**20
    extra_continuations: int = 8
    max_settings_entries: int = 32
    pings: Rate = Rate(1000, 1000.0)
    settings: Rate = Rate(100, 10.0)
    resets: Rate | None = Rate(1000, 33.0)
    """None on a cloud's replicas: their client is the gateway, whose calls are cancelled when its own clients'
    are (each bounded at the gateway), so its resets are not the replica's to bound."""
    window_updates_per_data_frame: int = 10
    priorities_per_stream: int = 100
    empty_frames_in_a_row: int = 1

    def __post_init__(self) -> None:
        for name in ("buffered_bytes_per_connection", "buffered_bytes_per_owner", "streams_per_owner"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"HTTP/2 limit {name} must be positive, got {value}")
        for name in ("message_timeout_s", "stall_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"HTTP/2 limit {name} must be a positive number of seconds, got {value}")

    def max_continuations(self, max_block_bytes: int) -> int:
        """CONTINUATION frames one header block may take: what a block of the limit needs in frames of the
        smallest size a client may use (16 KiB), and ``extra_continuations`` more."""
        return -(-max_block_bytes // DEFAULT_FRAME) + self.extra_continuations


class Bucket:
    """A token bucket: ``take(now)`` spends one token if there is one; tokens come back at ``per_s``, up to the
    burst."""

    __slots__ = ("_at", "_rate", "_tokens")

    def __init__(self, rate: Rate, now: float) -> None:
        self._rate = rate
        self._tokens = float(rate.burst)
        self._at = now

    def take(self, now: float) -> bool:
        rate = self._rate
        self._tokens = min(float(rate.burst), self._tokens + (now - self._at) * rate.per_s)
        self._at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


class FrameBudget:
    """One connection's allowance of frames that carry no call (the module's table): :meth:`over` is asked about
    each frame before it is handled and says why the connection must close, or None."""

    __slots__ = ("_clock", "_limits", "_pings", "_priorities", "_resets", "_settings", "_updates",
                 "data_sent", "empty", "opened")  # fmt: skip

    def __init__(self, limits: Http2Limits, clock: Callable[[], float]) -> None:
        self._limits = limits
        self._clock = clock
        now = clock()
        self._pings = Bucket(limits.pings, now)
        self._settings = Bucket(limits.settings, now)
        self._resets = None if limits.resets is None else Bucket(limits.resets, now)
        self._updates = self._priorities = self.empty = 0
        self.opened = 0
        """Streams the client has opened."""
        self.data_sent = 0
        """DATA frames sent to the client."""
        # self.empty: empty frames in a row (a frame with a payload sets it to 0)

    def over(self, kind: int, flags: int, length: int) -> str | None:
        limits = self._limits
        if length == 0 and kind in (DATA, HEADERS, CONTINUATION) and not flags & END_STREAM:
            self.empty += 1
            if self.empty > limits.empty_frames_in_a_row:
                return f"more than {limits.empty_frames_in_a_row} empty frame(s) in a row"
            return None
        self.empty = 0
        if kind == PING and not flags & 1 and not self._pings.take(self._clock()):
            return f"PINGs faster than {limits.pings.per_s:g} a second (burst {limits.pings.burst})"
        if kind == SETTINGS and not flags & 1 and not self._settings.take(self._clock()):
            return f"SETTINGS faster than {limits.settings.per_s:g} a second (burst {limits.settings.burst})"
        if kind == RST_STREAM and self._resets is not None and not self._resets.take(self._clock()):
            rate = limits.resets
            assert rate is not None
            return f"streams reset faster than {rate.per_s:g} a second (burst {rate.burst})"
        if kind == WINDOW_UPDATE:
            self._updates += 1
            if self._updates > 5 + 2 * (self.opened + limits.window_updates_per_data_frame * self.data_sent):
                return f"{self._updates} WINDOW_UPDATE frames for {self.data_sent} DATA frames sent"
        elif kind == PRIORITY:
            self._priorities += 1
            if self._priorities > limits.priorities_per_stream * (1 + self.opened):
                return f"{self._priorities} PRIORITY frames for {self.opened} streams"
        return None


class InputBudget:
    """What calls whose message has not completed hold, per owner (the caller, from the server's ``owner`` hook)
    over every connection: bytes and streams."""

    __slots__ = ("_limits", "bytes", "streams")

    def __init__(self, limits: Http2Limits) -> None:
        self._limits = limits
        self.bytes: dict[Hashable, int] = {}
        self.streams: dict[Hashable, int] = {}

    def open(self, owner: Hashable) -> str | None:
        """One more stream for ``owner``, or why not."""
        bound = self._limits.streams_per_owner
        held = self.streams.get(owner, 0)
        if bound is not None and held >= bound:
            return f"more than {bound} calls of this caller are waiting for their message"
        self.streams[owner] = held + 1
        return None

    def close(self, owner: Hashable) -> None:
        left = self.streams.get(owner, 0) - 1
        if left > 0:
            self.streams[owner] = left
        else:
            self.streams.pop(owner, None)

    def take(self, owner: Hashable, n: int, connection_held: int) -> str | None:
        """``n`` more bytes held for ``owner`` on a connection already holding ``connection_held``, or why not."""
        limits = self._limits
        per_connection = limits.buffered_bytes_per_connection
        if per_connection is not None and connection_held + n > per_connection:
            return f"more than {per_connection} bytes of unfinished calls on this connection"
        held = self.bytes.get(owner, 0)
        per_owner = limits.buffered_bytes_per_owner
        if per_owner is not None and held + n > per_owner:
            return f"more than {per_owner} bytes of this caller's unfinished calls"
        self.bytes[owner] = held + n
        return None

    def give_back(self, owner: Hashable, n: int) -> None:
        left = self.bytes.get(owner, 0) - n
        if left > 0:
            self.bytes[owner] = left
        else:
            self.bytes.pop(owner, None)


__all__ = ["Bucket", "FrameBudget", "Http2Limits", "InputBudget", "Rate"]
