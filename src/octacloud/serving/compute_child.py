"""The child side of a model's compute in a process of its own (:mod:`octacloud.serving.compute`), and the wire
both sides speak: frames of a 4-byte little-endian length and a pickle (protocol 5) over the private socketpair
the replica made. The child loads what the first frame names, then answers each batch, in order, until the
replica's end of the socket closes."""

from __future__ import annotations

import pickle
import signal
import socket
import struct
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from octacloud.serving.errors import ModelConfigError

LENGTH = struct.Struct("<I")
"""A frame's length prefix."""


def frame(message: tuple[Any, ...]) -> bytes:
    body = pickle.dumps(message, protocol=5)
    return LENGTH.pack(len(body)) + body


def _read_exactly(sock: socket.socket, n: int) -> bytes | None:
    """``n`` bytes from a blocking socket, or None at end of file."""
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_frame(sock: socket.socket) -> tuple[Any, ...] | None:
    head = _read_exactly(sock, LENGTH.size)
    if head is None:
        return None
    body = _read_exactly(sock, LENGTH.unpack(head)[0])
    if body is None:
        return None
    message = pickle.loads(body)
    assert isinstance(message, tuple)
    return message


def _error(e: BaseException) -> tuple[Any, ...]:
    return ("error", type(e).__name__, str(e), isinstance(e, ModelConfigError))


def serve(sock: socket.socket) -> None:
    """The child's loop: load what the first frame names, then answer each batch until the socket closes."""
    first = read_frame(sock)
    if first is None:
        return
    _, factory, version_dir, config_bytes, threads = first
    config = mc.ModelConfig()
    config.ParseFromString(config_bytes)
    try:
        runtime = factory(Path(version_dir), config, threads)
        meta = (tuple(runtime.inputs), tuple(runtime.outputs), runtime.device, getattr(runtime, "couples_rows", False))
    except Exception as e:
        sock.sendall(frame(_error(e)))
        return
    sock.sendall(frame(("ok", meta)))
    try:
        while (message := read_frame(sock)) is not None:
            try:
                answer: tuple[Any, ...] = ("ok", runtime.run(message[1], message[2]))
            except Exception as e:  # the batch fails, the child goes on
                answer = _error(e)
            sock.sendall(frame(answer))
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        runtime.close()


def main(argv: Sequence[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: (started by a replica) octacloud.serving.compute_child.main([FD])", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the replica's to handle; it closes the socket
    sock = socket.socket(fileno=int(argv[0]))
    try:
        serve(sock)
    finally:
        sock.close()
    return 0
