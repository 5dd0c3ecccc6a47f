"""The replica's REST server (octacloud's HTTP/1.1 server) answers pipelined keep-alive requests whole and in order."""

from __future__ import annotations

import json
import socket

import pytest

from .conftest import MAX_BODY, ThreadedServer, build_repository, start


def test_keep_alive_requests_each_get_a_whole_response(server: ThreadedServer) -> None:
    host, port = server.http.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        for _ in range(3):
            two = b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\nGET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
            s.sendall(two)  # pipelined
            got = b""
            while got.count(b"HTTP/1.1 200") < 2:
                chunk = s.recv(65536)
                assert chunk
                got += chunk
            assert got.startswith(b"HTTP/1.1 200 OK\r\n")
            assert b"server: uvicorn" not in got


def _infer(version: str = "", body: bytes | None = None) -> bytes:
    path = f"/v2/models/add{'/versions/' + version if version else ''}/infer"
    if body is None:
        data = [1.0, 2.0, 3.0, 4.0]
        body = json.dumps(
            {
                "inputs": [
                    {"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": data},
                    {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": data},
                ]
            }
        ).encode()
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


def _answers(s: socket.socket, n: int) -> list[tuple[int, bytes]]:
    """``n`` answers (status, body) read off ``s`` in order (each has a content-length)."""
    buf, out = b"", []
    while len(out) < n:
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            assert chunk, f"connection closed after {len(out)} answers"
            buf += chunk
        head, buf = buf.split(b"\r\n\r\n", 1)
        lines = head.split(b"\r\n")
        length = next(int(v) for k, _, v in (line.partition(b": ") for line in lines[1:]) if k == b"content-length")
        while len(buf) < length:
            chunk = s.recv(65536)
            assert chunk
            buf += chunk
        out.append((int(lines[0].split()[1]), buf[:length]))
        buf = buf[length:]
    return out


def test_pipelined_inferences_and_other_routes_are_answered_in_order(server: ThreadedServer) -> None:
    """Inference is answered by the native handler, the other routes by the ASGI app: one connection, in order."""
    host, port = server.http.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            _infer()
            + b"GET /v2/models/add HTTP/1.1\r\nHost: x\r\n\r\n"
            + _infer("2")
            + _infer(body=b"{not json")
            + _infer("9")
            + b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        answers = _answers(s, 6)
    assert [status for status, _ in answers] == [200, 200, 200, 400, 404, 200]
    assert json.loads(answers[0][1])["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]
    assert json.loads(answers[1][1])["name"] == "add"
    assert json.loads(answers[2][1])["model_version"] == "2"
    assert "error" in json.loads(answers[3][1]) and "error" in json.loads(answers[4][1])


def test_a_body_over_the_limit_is_refused_before_it_is_read(server: ThreadedServer) -> None:
    host, port = server.http.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v2/models/add/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY + 1))
        ((status, body),) = _answers(s, 1)
    assert status == 413 and b"over the limit" in body


def test_a_body_that_does_not_arrive_in_time_is_answered_408_and_the_connection_closed(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    slow = start(build_repository(tmp_path_factory.mktemp("models")), body_timeout_s=0.3)
    try:
        host, port = slow.http.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"POST /v2/models/add/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            ((status, body),) = _answers(s, 1)
            assert status == 408 and b"did not arrive" in body
            assert s.recv(100) == b""  # closed
        with socket.create_connection((host, int(port)), timeout=10) as s:  # the server still serves
            s.sendall(_infer())
            assert _answers(s, 1)[0][0] == 200
    finally:
        slow.stop()
