"""An open-loop load generator that keeps up, over HTTP/1.1 and gRPC (HTTP/2), that counts refusals.

    .venv/bin/python bench/openloop.py http 127.0.0.1:8000 mlp input:256 --rate 4000 --seconds 5 [--key KEY]
    .venv/bin/python bench/openloop.py grpc 127.0.0.1:8001 mlp input:256 --rate 4000 --procs 2
    .venv/bin/python bench/openloop.py grpc 127.0.0.1:8001 mlp input:256 --concurrency 8    # closed loop

Why not ``bench/loadgen.py`` (grpc.aio) or perf_analyzer: a Python asyncio client falls behind its own
schedule above a few thousand calls a second, more so when calls fail (grpc.aio raises an exception per
refused call), so the requests it sends bunch into bursts and the latencies it reports are its own; and
perf_analyzer stops at the first refused request, so it cannot measure load shedding at all.

Here several processes each send their share of one Poisson schedule (the sum of independent Poisson
processes is Poisson at the sum of the rates), each on one ``epoll`` loop over non-blocking sockets with
requests encoded once: HTTP/1.1 keep-alive (one request at a time per connection, a new connection whenever
no idle one is free) or gRPC over a minimal HTTP/2 client (one write of HEADERS + DATA per call, the header
block HPACK literals encoded once, responses decoded with the ``hpack`` package; SETTINGS, PING, flow control
and GOAWAY honoured; a few connections, as that many gRPC clients, with many streams each, and a call the
server's streams or window have no room for waiting in the client as in a gRPC client). A ``timerfd`` wakes
the loop at each send time, so a request leaves within microseconds of its schedule instead of at the next
millisecond.

Latency is measured from each request's *scheduled* send time, so a client that falls behind cannot hide it
(it shows up as latency), and the lag itself (when the client got to the request − scheduled) is reported: a
point whose client lag p99 is large says more about the client than about the server. Outcomes: ``ok`` (HTTP
200, grpc-status 0), ``refused`` (load shed: HTTP 429/503, gRPC UNAVAILABLE/RESOURCE_EXHAUSTED, or HTTP/2's
RST_STREAM REFUSED_STREAM, a call not processed), whether the refusal carried ``Retry-After`` (header or
trailing metadata), and errors by kind. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import pickle
import random
import select
import socket
import struct
import subprocess
import sys
import time
from array import array
from collections import Counter, deque
from dataclasses import dataclass, field, fields
from typing import Any

import hpack

GRPC_PATH = "/inference.GRPCInferenceService/ModelInfer"
REFUSED_HTTP = (429, 503)
REFUSED_GRPC = ("14", "8")  # UNAVAILABLE, RESOURCE_EXHAUSTED; and RST_STREAM REFUSED_STREAM (not processed)
REFUSED_STREAM = 7
UNSENT = "unsent (every connection busy)"  # HTTP: not an answer of the server's; the client's connection bound
_FH = struct.Struct(">BHBBI")  # frame header: length (8 + 16 bits), type, flags, stream
_U32 = struct.Struct(">I")
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
MAX_WINDOW = 2**31 - 1


# ---- requests, encoded once -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    protocol: str
    """``http`` or ``grpc``."""
    host: str
    port: int
    request: bytes
    """HTTP: the whole request. gRPC: the serialised ``ModelInferRequest``."""
    headers: tuple[tuple[str, str], ...] = ()
    """Sent with every request (``authorization``, the internal secret); gRPC: as metadata."""
    path: str = GRPC_PATH
    """gRPC: the method."""


def infer_message(model: str, shape: str) -> bytes:
    """A ``ModelInferRequest`` with one FP32 input of ``NAME:DIMS`` (batch 1, raw contents)."""
    import numpy as np
    from tritonclient.grpc import service_pb2 as pb

    name, dims = shape.split(":")
    full = [1, *(int(d) for d in dims.split(","))]
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name=name, datatype="FP32", shape=full)
    request.raw_input_contents.append(np.random.default_rng(0).random(full, dtype=np.float32).tobytes())
    out: bytes = request.SerializeToString()
    return out


def http_infer_request(model: str, shape: str, headers: tuple[tuple[str, str], ...] = ()) -> bytes:
    """``POST /v2/models/MODEL/infer`` with the input as Triton binary tensor data (as perf_analyzer sends)."""
    import numpy as np

    name, dims = shape.split(":")
    full = [1, *(int(d) for d in dims.split(","))]
    raw = np.random.default_rng(0).random(full, dtype=np.float32).tobytes()
    head = json.dumps(
        {"inputs": [{"name": name, "shape": full, "datatype": "FP32", "parameters": {"binary_data_size": len(raw)}}]},
        separators=(",", ":"),
    ).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers)
    return (
        (
            f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: bench\r\nContent-Type: application/octet-stream\r\n"
            f"Inference-Header-Content-Length: {len(head)}\r\nContent-Length: {len(head) + len(raw)}\r\n{extra}\r\n"
        ).encode()
        + head
        + raw
    )


def _int_prefix(n: int, bits: int) -> bytearray:
    limit = (1 << bits) - 1
    if n < limit:
        return bytearray((n,))
    out, n = bytearray((limit,)), n - limit
    while n >= 128:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return out


def _literal(name: str, value: str) -> bytes:
    """A header field as a literal without indexing, new name, no Huffman (RFC 7541 6.2.2): the same bytes on
    every request, whatever the decoder's table holds."""
    n, v = name.encode(), value.encode()
    return bytes(b"\x00" + _int_prefix(len(n), 7) + n + _int_prefix(len(v), 7) + v)


def grpc_header_block(target: Target) -> bytes:
    block = b"\x83\x86"  # :method POST, :scheme http (static table)
    block += _literal(":path", target.path) + _literal(":authority", f"{target.host}:{target.port}")
    block += _literal("content-type", "application/grpc") + _literal("te", "trailers")
    for k, v in target.headers:
        block += _literal(k.lower(), v)
    return block


# ---- what a worker does and what it saw -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Plan:
    target: Target
    start_at: float
    """``time.monotonic()`` (one clock for every process on the machine) of the first scheduled send."""
    seconds: float
    """Measured window, after the warm-up."""
    warmup_s: float = 1.0
    rate: float = 0.0
    """Open loop: this worker's share of the arrivals per second (Poisson). 0: closed loop."""
    concurrency: int = 1
    """Closed loop: requests kept in flight (each sent as soon as the previous one is answered)."""
    seed: int = 0
    max_connections: int = 2048
    """HTTP: connections at most (a request due when all are busy is counted ``unsent``)."""
    preopen: int = 16
    """HTTP: connections opened before the clock starts (more open whenever no idle one is free)."""
    h2_connections: int = 2
    """gRPC: connections, opened before the clock starts (as that many gRPC clients would). A call due when
    they have no room (the server's SETTINGS_MAX_CONCURRENT_STREAMS, its flow-control window) waits in the
    client as a gRPC client's would: that wait is the server's backpressure and counts in its latency, not in
    the client's lag."""
    drain_s: float = 10.0
    """After the last send, how long answers are waited for; what is still open then is a ``timeout``."""


@dataclass(slots=True)
class Result:
    ok: array[float] = field(default_factory=lambda: array("d"))
    """Latency of each answered request, from its scheduled send time (seconds)."""
    ok_from_send: array[float] = field(default_factory=lambda: array("d"))
    refused: array[float] = field(default_factory=lambda: array("d"))
    """Time to the refusal, from the scheduled send time."""
    refused_with_retry_after: int = 0
    lag: array[float] = field(default_factory=lambda: array("d"))
    """For every measured request, when the client got to it (sent it, or queued it behind the server's HTTP/2
    flow control) − its scheduled time: the client's own lateness."""
    errors: Counter[str] = field(default_factory=Counter)
    codes: Counter[str] = field(default_factory=Counter)
    """Every measured outcome by status (HTTP status or ``grpc-N``)."""
    seconds: float = 0.0
    sent_all: int = 0
    """Requests sent over the whole run, the warm-up and the drain included (for CPU per request)."""
    connections: int = 0
    cpu_s: float = 0.0
    """The worker's own CPU time over the run."""

    def merge(self, other: Result) -> None:
        self.ok.extend(other.ok)
        self.ok_from_send.extend(other.ok_from_send)
        self.refused.extend(other.refused)
        self.refused_with_retry_after += other.refused_with_retry_after
        self.lag.extend(other.lag)
        self.errors.update(other.errors)
        self.codes.update(other.codes)
        self.seconds = max(self.seconds, other.seconds)
        self.sent_all += other.sent_all
        self.connections += other.connections
        self.cpu_s += other.cpu_s

    @property
    def sent(self) -> int:
        return len(self.lag)

    def summary(self) -> dict[str, Any]:
        s = self.seconds or float("nan")
        return {
            "sent_per_s": round(self.sent / s, 1),
            "ok_per_s": round(len(self.ok) / s, 1),
            "refused_per_s": round(len(self.refused) / s, 1),
            "errors": dict(self.errors),
            "codes": dict(self.codes),
            "p50_ms": ms(pct(self.ok, 0.5)),
            "p99_ms": ms(pct(self.ok, 0.99)),
            "p99_from_send_ms": ms(pct(self.ok_from_send, 0.99)),
            "refusal_p50_ms": ms(pct(self.refused, 0.5)),
            "refusal_p99_ms": ms(pct(self.refused, 0.99)),
            "retry_after_share": round(self.refused_with_retry_after / len(self.refused), 3) if self.refused else None,
            "client_lag_p50_ms": ms(pct(self.lag, 0.5)),
            "client_lag_p99_ms": ms(pct(self.lag, 0.99)),
            "client_cpu_us_per_request": round(self.cpu_s / self.sent * 1e6, 1) if self.sent else None,
            "connections": self.connections,
        }


def pct(values: Any, q: float) -> float:
    if not len(values):
        return float("nan")
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def ms(x: float) -> float:
    return round(x * 1e3, 3)


# ---- a timer with microsecond wake-ups (epoll's own timeout is in milliseconds) -------------------------


class _Timer:
    """``timerfd`` on CLOCK_MONOTONIC through libc (``os.timerfd_create`` arrived in Python 3.13)."""

    class _Itimerspec(ctypes.Structure):
        _fields_ = [("it_interval", ctypes.c_long * 2), ("it_value", ctypes.c_long * 2)]

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.timerfd_create(time.CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create")
        self._spec = self._Itimerspec()
        self._ref = ctypes.byref(self._spec)
        self._settime = self._libc.timerfd_settime
        self.armed = -1.0

    def arm(self, at: float) -> None:
        """Fire at monotonic time ``at`` (absolute)."""
        if at == self.armed:
            return
        sec = int(at)
        self._spec.it_value[0] = sec
        self._spec.it_value[1] = max(1, int((at - sec) * 1e9))  # 0 0 would disarm it
        self._settime(self.fd, 1, self._ref, None)  # TFD_TIMER_ABSTIME
        self.armed = at

    def clear(self) -> None:
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            pass
        self.armed = -1.0

    def close(self) -> None:
        os.close(self.fd)


# ---- connections ---------------------------------------------------------------------------------------

_IN, _OUT = select.EPOLLIN, select.EPOLLOUT


class _Conn:
    __slots__ = ("buf", "connected", "dead", "fd", "out", "sock", "worker")

    def __init__(self, worker: _Worker, sock: socket.socket, connected: bool) -> None:
        self.worker, self.sock, self.fd = worker, sock, sock.fileno()
        self.buf = bytearray()
        self.out = bytearray()
        self.connected = connected
        self.dead = False
        worker.poll.register(self.fd, _IN | (0 if connected else _OUT))
        worker.conns[self.fd] = self

    def write(self, data: bytes) -> None:
        if self.out or not self.connected:
            self.out += data
            return
        try:
            n = self.sock.send(data)
        except BlockingIOError:
            n = 0
        except OSError:
            self.lost("send failed")
            return
        if n < len(data):
            self.out += data[n:]
            self.worker.poll.modify(self.fd, _IN | _OUT)

    def writable(self) -> None:
        if not self.connected:
            err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self.lost(f"connect: {os.strerror(err)}")
                return
            self.connected = True
            self.on_connected()
        if self.out:
            try:
                n = self.sock.send(self.out)
            except BlockingIOError:
                return
            except OSError:
                self.lost("send failed")
                return
            del self.out[:n]
        if not self.out and not self.dead:
            self.worker.poll.modify(self.fd, _IN)

    def readable(self) -> None:
        try:
            data = self.sock.recv(262144)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.lost("closed by the server")
            return
        self.buf += data
        self.parse()

    def close(self) -> None:
        if self.dead:
            return
        self.dead = True
        self.worker.conns.pop(self.fd, None)
        try:
            self.worker.poll.unregister(self.fd)
        except (OSError, ValueError):
            pass
        self.sock.close()

    def on_connected(self) -> None:
        pass

    def parse(self) -> None:
        raise NotImplementedError

    def lost(self, why: str) -> None:
        raise NotImplementedError


class _H1(_Conn):
    """One HTTP/1.1 keep-alive connection, one request at a time."""

    __slots__ = ("req",)

    def __init__(self, worker: _Worker, sock: socket.socket, connected: bool) -> None:
        super().__init__(worker, sock, connected)
        self.req = -1

    def start(self, idx: int) -> None:
        self.req = idx
        self.write(self.worker.http_request)

    def parse(self) -> None:
        buf = self.buf
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buf[:end]).lower()
            i = head.find(b"\r\ncontent-length:")
            if i < 0:
                self.lost("an answer without Content-Length")
                return
            j = head.find(b"\r\n", i + 17)
            length = int(head[i + 17 : j if j > 0 else len(head)])
            total = end + 4 + length
            if len(buf) < total:
                return
            del buf[:total]
            status = int(head[9:12])
            idx, self.req = self.req, -1
            if idx < 0:
                self.lost("an answer to no request")
                return
            w = self.worker
            w.complete(idx, status == 200, status in REFUSED_HTTP, str(status), b"\r\nretry-after:" in head)
            if b"\r\nconnection: close" in head:
                self.close()
                w.http_open -= 1
            else:
                w.idle.append(self)

    def lost(self, why: str) -> None:
        if self.dead:
            return
        w = self.worker
        self.close()
        w.http_open -= 1
        if self.req >= 0:
            w.fail(self.req, why)
            self.req = -1
        else:
            try:
                w.idle.remove(self)
            except ValueError:
                pass


class _H2(_Conn):
    """One HTTP/2 connection carrying many gRPC calls; what a unary gRPC client needs of RFC 9113."""

    __slots__ = (
        "cont",
        "decoder",
        "going_away",
        "max_streams",
        "next_sid",
        "peer_window",
        "received",
        "streams",
        "window",
    )

    def __init__(self, worker: _Worker, sock: socket.socket, connected: bool) -> None:
        super().__init__(worker, sock, connected)
        self.decoder = hpack.Decoder()
        self.next_sid = 1
        self.streams: dict[int, list[Any]] = {}  # id -> [request index, headers seen, retry-after seen]
        self.window = 65535  # what we may still send on the connection
        self.peer_window = 65535  # each new stream's send window (the server's SETTINGS_INITIAL_WINDOW_SIZE)
        self.max_streams = 100  # until the server's SETTINGS say otherwise
        self.going_away = False
        self.cont: tuple[int, int, bytearray] | None = None  # a header block awaiting CONTINUATION
        self.received = 0
        settings = struct.pack(">HIHI", 0x2, 0, 0x4, MAX_WINDOW)  # no push; stream windows as large as allowed
        self.write(
            PREFACE + _frame(SETTINGS, 0, 0, settings) + _frame(WINDOW_UPDATE, 0, 0, _U32.pack(MAX_WINDOW - 65535))
        )

    def room(self) -> bool:
        n = len(self.worker.grpc_data)
        return (
            not self.going_away
            and len(self.streams) < self.max_streams
            and self.window >= n
            and self.peer_window >= n
            and self.next_sid < MAX_WINDOW
        )

    def start(self, idx: int) -> None:
        w = self.worker
        sid = self.next_sid
        self.next_sid += 2
        self.streams[sid] = [idx, False, False]
        block, data = w.grpc_block, w.grpc_data
        self.window -= len(data)
        self.write(
            _FH.pack(len(block) >> 16, len(block) & 0xFFFF, HEADERS, END_HEADERS, sid)
            + block
            + _FH.pack(len(data) >> 16, len(data) & 0xFFFF, DATA, END_STREAM, sid)
            + data
        )

    def parse(self) -> None:
        buf = self.buf
        pos, end = 0, len(buf)
        while end - pos >= 9:
            length = (buf[pos] << 16) | (buf[pos + 1] << 8) | buf[pos + 2]
            if end - pos < 9 + length:
                break
            kind, flags = buf[pos + 3], buf[pos + 4]
            sid = _U32.unpack_from(buf, pos + 5)[0] & MAX_WINDOW
            payload = bytes(buf[pos + 9 : pos + 9 + length])
            pos += 9 + length
            self.frame(kind, flags, sid, payload)
            if self.dead:
                return
        del buf[:pos]
        if self.received > 2**24:
            self.write(_frame(WINDOW_UPDATE, 0, 0, _U32.pack(self.received)))
            self.received = 0

    def frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if kind in (HEADERS, CONTINUATION):
            if kind == HEADERS:
                start, stop = 0, len(payload)
                if flags & PADDED:
                    start, stop = 1, stop - payload[0]
                if flags & PRIORITY:
                    start += 5
                self.cont = (sid, flags, bytearray(payload[start:stop]))
            elif self.cont is not None:
                self.cont[2].extend(payload)
            if flags & END_HEADERS and self.cont is not None:
                first_sid, first_flags, block = self.cont
                self.cont = None
                self.headers(first_sid, first_flags, bytes(block))
        elif kind == DATA:
            self.received += len(payload)
            if flags & END_STREAM:
                self.finish(sid, None, "DATA ended the stream without trailers")
        elif kind == SETTINGS:
            if not flags & ACK:
                for i in range(0, len(payload) - 5, 6):
                    key, value = struct.unpack_from(">HI", payload, i)
                    if key == 0x3:
                        self.max_streams = value
                    elif key == 0x4:
                        self.peer_window = value
                self.write(_frame(SETTINGS, ACK, 0))
                self.worker.wake()
        elif kind == PING:
            if not flags & ACK:
                self.write(_frame(PING, ACK, 0, payload))
        elif kind == WINDOW_UPDATE:
            if sid == 0:
                self.window += _U32.unpack(payload)[0] & MAX_WINDOW
                self.worker.wake()
        elif kind == RST_STREAM:
            code = _U32.unpack(payload)[0]
            if code == REFUSED_STREAM:  # HTTP/2's own refusal: the call was not processed (grpc's overload guard)
                self.finish(sid, "refused-stream", "")
            else:
                self.finish(sid, None, f"RST_STREAM {code}")
        elif kind == GOAWAY:
            self.going_away = True
            last = _U32.unpack_from(payload, 0)[0] & MAX_WINDOW
            for s in [s for s in self.streams if s > last]:
                self.finish(s, None, "GOAWAY")
            if not self.streams:
                self.lost("GOAWAY")

    def headers(self, sid: int, flags: int, block: bytes) -> None:
        try:
            fields = self.decoder.decode(block, raw=True)
        except hpack.HPACKError as e:
            self.lost(f"HPACK: {e}")
            return
        s = self.streams.get(sid)
        if s is None:
            return
        status = None
        for k, v in fields:
            if k == b"grpc-status":
                status = v.decode()
            elif k == b"retry-after":
                s[2] = True
            elif k == b":status" and v != b"200":
                self.finish(sid, None, f"HTTP {v.decode()}")
                return
        if flags & END_STREAM:
            if status is None:
                self.finish(sid, None, "trailers without grpc-status")
            else:
                self.finish(sid, status, "")

    def finish(self, sid: int, status: str | None, why: str) -> None:
        s = self.streams.pop(sid, None)
        if s is None:
            return
        w = self.worker
        if status is None:
            w.fail(s[0], why)
        else:
            refused = status in REFUSED_GRPC or status == "refused-stream"
            w.complete(s[0], status == "0", refused, f"grpc-{status}", s[2])
        w.wake()
        if self.going_away and not self.streams:
            self.lost("GOAWAY")

    def lost(self, why: str) -> None:
        if self.dead:
            return
        self.close()
        w = self.worker
        w.h2.remove(self)
        for s in self.streams.values():
            w.fail(s[0], why)
        self.streams.clear()
        w.wake()


def _frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _FH.pack(n >> 16, n & 0xFFFF, kind, flags, sid) + payload


# ---- the worker ----------------------------------------------------------------------------------------


class _Worker:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        t = plan.target
        self.poll = select.epoll()
        self.conns: dict[int, _Conn] = {}
        self.result = Result()
        self.measure_from = plan.start_at + plan.warmup_s
        self.end = self.measure_from + plan.seconds
        self.http_request = t.request if t.protocol == "http" else b""
        self.grpc_block = grpc_header_block(t) if t.protocol == "grpc" else b""
        self.grpc_data = b"\x00" + _U32.pack(len(t.request)) + t.request if t.protocol == "grpc" else b""
        self.idle: list[_H1] = []
        self.http_open = 0
        self.h2: list[_H2] = []
        self.backlog: deque[int] = deque()  # gRPC calls due that no connection has room for yet
        self.sched: list[float] = []
        self.sent: list[float] = []
        self.inflight = 0
        self.closed_loop = plan.rate <= 0
        self.pending_closed = 0  # closed loop: answers in, their successors not yet sent
        self._woken = False

    # -- connections --
    def _socket(self, blocking: bool) -> tuple[socket.socket, bool]:
        t = self.plan.target
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if blocking:
            sock.connect((t.host, t.port))
            sock.setblocking(False)
            return sock, True
        sock.setblocking(False)
        err = sock.connect_ex((t.host, t.port))
        return sock, err == 0

    def open_http(self, blocking: bool = False) -> _H1:
        sock, connected = self._socket(blocking)
        self.http_open += 1
        self.result.connections += 1
        return _H1(self, sock, connected)

    def open_h2(self, blocking: bool = False) -> _H2:
        sock, connected = self._socket(blocking)
        c = _H2(self, sock, connected)
        self.h2.append(c)
        self.result.connections += 1
        return c

    # -- requests --
    def dispatch(self, idx: int) -> None:
        self.inflight += 1
        self.result.sent_all += 1
        self.sent[idx] = time.monotonic()  # the client's own lateness ends here; any wait after is the server's
        if self.plan.target.protocol == "http":
            if self.idle:
                self.idle.pop().start(idx)
            elif self.http_open < self.plan.max_connections:
                self.open_http().start(idx)
            else:
                self.inflight -= 1
                if self.sched[idx] >= self.measure_from:
                    self.result.errors[UNSENT] += 1
            return
        if self.backlog:
            self.backlog.append(idx)
            return
        for c in self.h2:
            if c.room():
                c.start(idx)
                return
        if len(self.h2) < self.plan.h2_connections:  # one was lost: replaced
            c = self.open_h2()
            if c.room():
                c.start(idx)
                return
        self.backlog.append(idx)

    def wake(self) -> None:
        """Something freed room on an HTTP/2 connection: the backlog may move (at the loop's next turn)."""
        self._woken = True

    def _drain_backlog(self) -> None:
        self._woken = False
        backlog = self.backlog
        while backlog:
            for c in self.h2:
                if c.room():
                    c.start(backlog.popleft())
                    break
            else:
                if len(self.h2) < self.plan.h2_connections:
                    self.open_h2()
                    continue
                return

    def complete(self, idx: int, ok: bool, refused: bool, code: str, retry_after: bool) -> None:
        self.inflight -= 1
        t0 = self.sched[idx]
        if self.measure_from <= t0 < self.end:
            now = time.monotonic()
            r = self.result
            r.lag.append(self.sent[idx] - t0)
            r.codes[code] += 1
            if ok:
                r.ok.append(now - t0)
                r.ok_from_send.append(now - self.sent[idx])
            elif refused:
                r.refused.append(now - t0)
                r.refused_with_retry_after += retry_after
            else:
                r.errors[code] += 1
        self._next_closed()

    def fail(self, idx: int, why: str) -> None:
        self.inflight -= 1
        t0 = self.sched[idx]
        if self.measure_from <= t0 < self.end:
            self.result.lag.append(self.sent[idx] - t0 if self.sent[idx] else 0.0)
            self.result.errors[why] += 1
            self.result.codes["error"] += 1
        self._next_closed()

    def _next_closed(self) -> None:
        if self.closed_loop and time.monotonic() < self.end:
            self.pending_closed += 1

    # -- the loop --
    def run(self) -> Result:
        plan = self.plan
        cpu0 = time.process_time()
        if plan.target.protocol == "http":
            for _ in range(min(plan.preopen, plan.max_connections)):
                self.idle.append(self.open_http(blocking=True))
        else:
            for _ in range(plan.h2_connections):
                self.open_h2(blocking=True)
        schedule: list[float] = []
        if not self.closed_loop:
            rng = random.Random(plan.seed)
            t = plan.start_at + rng.expovariate(plan.rate)
            while t < self.end:
                schedule.append(t)
                t += rng.expovariate(plan.rate)
        self.sched = schedule
        self.sent = [0.0] * len(schedule)
        timer: _Timer | None
        try:
            timer = _Timer()
            self.poll.register(timer.fd, _IN)
        except (OSError, AttributeError):
            timer = None
        delay = plan.start_at - time.monotonic()
        if delay > 0:
            self._serve_for(delay)  # answer SETTINGS and the like while waiting for the start
        if self.closed_loop:
            self.pending_closed = plan.concurrency
        i, n = 0, len(schedule)
        deadline = self.end + plan.drain_s
        mono = time.monotonic
        conns, poll = self.conns, self.poll
        while True:
            now = mono()
            while i < n and schedule[i] <= now:
                self.dispatch(i)
                i += 1
            while self.pending_closed:
                self.pending_closed -= 1
                idx = len(self.sched)
                self.sched.append(now)
                self.sent.append(0.0)
                self.dispatch(idx)
            if self._woken and self.backlog:
                self._drain_backlog()
            if i < n:
                if timer is not None:
                    timer.arm(schedule[i])
                    wait = -1.0
                else:
                    wait = max(0.0, schedule[i] - now)
            else:
                if (self.inflight <= 0 and (not self.closed_loop or now >= self.end)) or now > deadline:
                    break
                wait = 0.05
            for fd, ev in poll.poll(wait):
                c = conns.get(fd)
                if c is None:
                    if timer is not None and fd == timer.fd:
                        timer.clear()
                    continue
                if ev & _OUT:
                    c.writable()
                if ev & (_IN | select.EPOLLERR | select.EPOLLHUP) and not c.dead:
                    c.readable()
        for c in list(conns.values()):
            if isinstance(c, _H1) and c.req >= 0:
                c.lost("timeout")
            elif isinstance(c, _H2):
                for s in list(c.streams):
                    c.finish(s, None, "timeout")
        for idx in self.backlog:
            self.fail(idx, "timeout (never sent)")
        for c in list(conns.values()):
            c.close()
        if timer is not None:
            timer.close()
        self.poll.close()
        self.result.seconds = plan.seconds
        self.result.cpu_s = time.process_time() - cpu0
        return self.result

    def _serve_for(self, seconds: float) -> None:
        until = time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0:
            for fd, ev in self.poll.poll(left):
                c = self.conns.get(fd)
                if c is not None:
                    if ev & _OUT:
                        c.writable()
                    if ev & (_IN | select.EPOLLERR | select.EPOLLHUP) and not c.dead:
                        c.readable()


def run_worker(plan: Plan) -> Result:
    """One worker in this process (blocks until its schedule is done and answered)."""
    return _Worker(plan).run()


# ---- several workers, one schedule ----------------------------------------------------------------------


def run_load(
    target: Target,
    *,
    seconds: float,
    rate: float = 0.0,
    concurrency: int = 1,
    procs: int = 2,
    warmup_s: float = 1.0,
    seed: int = 0,
    max_connections: int = 2048,
    preopen: int = 16,
    h2_connections: int = 4,
    lead_s: float = 0.5,
) -> Result:
    """Open loop at ``rate`` (or a closed loop of ``concurrency``) split over ``procs`` worker processes, each
    with its share of the rate (or of the concurrency) and its own connections; their results merged."""
    procs = max(1, min(procs, concurrency) if rate <= 0 else procs)
    start_at = time.monotonic() + lead_s + 0.15 * procs  # every worker started and connected before it
    plans = []
    for k in range(procs):
        share = concurrency // procs + (1 if k < concurrency % procs else 0)
        plans.append(
            Plan(
                target,
                start_at,
                seconds,
                warmup_s=warmup_s,
                rate=rate / procs if rate > 0 else 0.0,
                concurrency=max(1, share),
                seed=seed * 1000 + k,
                max_connections=max(1, max_connections // procs),
                preopen=max(1, preopen // procs),
                h2_connections=max(1, h2_connections // procs),
            )
        )
    children = [
        subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        for _ in plans
    ]
    for child, plan in zip(children, plans, strict=True):
        assert child.stdin is not None
        wire = {f.name: getattr(plan, f.name) for f in fields(Plan)}
        wire["target"] = {f.name: getattr(target, f.name) for f in fields(Target)}
        child.stdin.write(pickle.dumps(wire))  # plain types only: the worker runs this file as __main__
        child.stdin.close()
    total = Result()
    for child in children:
        assert child.stdout is not None
        with child.stdout:
            out = child.stdout.read()
        if child.wait() != 0 or not out:
            raise RuntimeError(f"a load generator worker failed (exit {child.returncode})")
        total.merge(Result(**pickle.loads(out)))
    return total


def _worker_main() -> None:
    wire = pickle.loads(sys.stdin.buffer.read())
    wire["target"] = Target(**wire["target"])
    result = run_worker(Plan(**wire))
    sys.stdout.buffer.write(pickle.dumps({f.name: getattr(result, f.name) for f in fields(Result)}))


def main() -> None:
    if sys.argv[1:] == ["--worker"]:
        _worker_main()
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("protocol", choices=["http", "grpc"])
    p.add_argument("target", help="HOST:PORT")
    p.add_argument("model")
    p.add_argument("shape", help="the input as NAME:DIMS without the batch dim, e.g. input:256")
    p.add_argument("--rate", type=float, default=0.0, help="open loop: requests per second (Poisson)")
    p.add_argument("--concurrency", type=int, default=1, help="closed loop (when --rate is 0)")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--key", default="", help="sent as authorization: Bearer KEY")
    p.add_argument("--header", action="append", default=[], help="NAME=VALUE, sent with every request")
    args = p.parse_args()
    host, _, port = args.target.rpartition(":")
    headers = tuple(tuple(h.split("=", 1)) for h in args.header)
    if args.key:
        headers = (("authorization", f"Bearer {args.key}"), *headers)
    request = (
        http_infer_request(args.model, args.shape, headers)  # type: ignore[arg-type]
        if args.protocol == "http"
        else infer_message(args.model, args.shape)
    )
    target = Target(args.protocol, host, int(port), request, headers)  # type: ignore[arg-type]
    result = run_load(
        target, seconds=args.seconds, rate=args.rate, concurrency=args.concurrency, procs=args.procs,
        warmup_s=args.warmup,
    )  # fmt: skip
    print(json.dumps({"load_average": os.getloadavg()[0], **result.summary()}))


if __name__ == "__main__":
    main()
