"""The malformed requests the issue found, one by one: each is a 400 naming what was wrong, never a 500."""

from __future__ import annotations

import json
import logging
import re
import urllib.error
import urllib.request

import pytest

from .conftest import ThreadedServer


def _input(**changes: object) -> dict[str, object]:
    return {"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4], **changes}


def _body(first: dict[str, object] | None = None, **top: object) -> str:
    inputs = [first or _input(), _input(name="INPUT1")]
    return json.dumps({"inputs": inputs, **top})


CASES = [
    ("list as datatype", _body(_input(datatype=["FP32"])), "'datatype' must be a string"),
    ("dict as name", _body(_input(name={"a": 1})), "'name' must be a string"),
    ("Infinity in a shape", _body(_input(shape=[float("inf"), 4])), "'shape' must be a list of integers"),
    ("1.5 in a shape", _body(_input(shape=[1.5, 4])), "'shape' must be a list of integers"),
    ("true in a shape", _body(_input(shape=[True, 4])), "'shape' must be a list of integers"),
    ("a string as shape", _body(_input(shape="14")), "'shape' must be a list of integers"),
    ("10^400 in data", _body(_input(data=[10**400, 1, 1, 1])), "data is not FP32"),
    ("non-dict parameters", _body(parameters=[1]), "'parameters' must be an object"),
    ("non-dict input parameters", _body(_input(parameters="x")), "'parameters' must be an object"),
    ("outputs: 5", _body(outputs=5), "'outputs' must be a list"),
    ("an output without a name", _body(outputs=[{"x": 1}]), "outputs\\[0\\] must be an object with a 'name'"),
    ("an output named by a list", _body(outputs=[{"name": [1]}]), "'name' must be a string"),
    ("1,000-deep nesting", '{"inputs": ' + "[" * 1000 + "]" * 1000 + "}", "nests JSON too deeply"),
    ("deep data", _body(_input(data=json.loads("[" * 40 + "1" + "]" * 40))), "1 values, but shape"),
    ("binary_data_size true", _body(_input(parameters={"binary_data_size": True})), "binary_data_size"),
    ("an object as id", _body(id={"a": 1}), "'id' must be a string"),
]


@pytest.mark.parametrize(("what", "body", "message"), CASES, ids=[c[0] for c in CASES])
def test_malformed_json_is_a_400_naming_the_problem(
    server: ThreadedServer, caplog: pytest.LogCaptureFixture, what: str, body: str, message: str
) -> None:
    caplog.set_level(logging.ERROR)
    req = urllib.request.Request(f"http://{server.http}/v2/models/add/infer", data=body.encode(), method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400
    error = json.loads(e.value.read())["error"]
    assert re.search(message, error), error
    assert not [r for r in caplog.records if r.name.startswith("octacloud")]
