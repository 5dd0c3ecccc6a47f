"""What `octacloud up` prints: one timed line per controller event, and a request that can be pasted."""

from __future__ import annotations

import json
import logging
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from octacloud.cli.cloud import as_typed
from octacloud.cli.down import adopted, left_running, stopped_by_down
from octacloud.cli.up import _Lines, event_line, log_events, sample_inputs, sample_requests
from octacloud.control.deployments import Replica, ReplicaState
from octacloud.control.store import StateStore
from octacloud.storage.store import FsspecStore


def test_every_stored_event_becomes_one_timed_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = StateStore.at(tmp_path / "octacloud.db")
    try:
        log_events(store)
        with caplog.at_level(logging.INFO, logger="octacloud.events"):
            store.add_event("ready", "mlp-0a0a0a", "serving on demo-a cards [0]")
            store.add_event("preempted", "low-1b1b1b", "by high-2c2c2c")
        assert [r.getMessage().split()[:2] for r in caplog.records] == [["ready", "mlp-0a0a0a"],
                                                                       ["preempted", "low-1b1b1b"]]  # fmt: skip
        line = _Lines().format(caplog.records[0])
        assert line[:8].count(":") == 2 and line[9:].startswith("ready")  # HH:MM:SS, then the event
        assert len(store.events()) == 2
    finally:
        store.close()


def test_a_failing_subscriber_does_not_fail_the_controller(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = StateStore.at(tmp_path / "octacloud.db")
    try:

        def broken(event: dict[str, object]) -> None:
            raise RuntimeError("full disk")

        store.subscribe(broken)
        store.add_event("ready", "x", "y")  # does not raise
        assert store.events()[0]["kind"] == "ready"
        assert "event listener failed" in caplog.text
    finally:
        store.close()


def test_event_line() -> None:
    assert event_line({"kind": "moved", "subject": "a-1", "message": "demo-a → demo-b"}).split() == [
        "moved", "a-1", "demo-a", "→", "demo-b"
    ]  # fmt: skip


CONFIG = """name: "embed"
max_batch_size: 8
input { name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] }
input { name: "text" data_type: TYPE_STRING dims: [ 1 ] }
input { name: "scale" data_type: TYPE_FP32 dims: [ 2, 3 ] }
output { name: "out" data_type: TYPE_FP32 dims: [ 4 ] }
"""


def test_the_printed_request_is_valid_for_the_model(tmp_path: Path) -> None:
    (tmp_path / "embed").mkdir()
    (tmp_path / "embed" / "config.pbtxt").write_text(CONFIG)
    inputs = sample_inputs(FsspecStore(str(tmp_path)), "embed")
    assert inputs is not None
    assert [(i["name"], i["shape"], i["datatype"]) for i in inputs] == [
        ("input_ids", [1, 8], "INT64"), ("text", [1, 1], "BYTES"), ("scale", [1, 2, 3], "FP32")
    ]  # fmt: skip
    curl, python = sample_requests("http://127.0.0.1:8000", "127.0.0.1:8001", "embed", inputs, Path("var/admin.key"))
    assert "curl -s http://127.0.0.1:8000/v2/models/embed/infer" in curl and "$(cat var/admin.key)" in curl
    body_command = shlex.split(curl.split(" | ")[0])
    assert body_command[:2] == [as_typed("python"), "-c"]  # the Python that runs octacloud, which has tritonclient
    assert Path(shutil.which(body_command[0]) or body_command[0]).resolve() == Path(sys.executable).resolve()
    body = json.loads(subprocess.run([sys.executable, "-c", body_command[2]], capture_output=True, text=True,
                                     check=True).stdout)  # fmt: skip
    assert [(t["name"], len(t["data"])) for t in body["inputs"]] == [("input_ids", 8), ("text", 1), ("scale", 6)]
    assert body["inputs"][1]["data"] == ["hello"]
    code = shlex.split(python)[2]
    compile(code, "<printed request>", "exec")  # a valid Python one-liner
    assert "'authorization'" not in code and '"authorization": "Bearer "' in code  # gRPC metadata: lower case


def test_no_request_is_printed_for_a_model_without_declared_inputs(tmp_path: Path) -> None:
    (tmp_path / "bare").mkdir()
    assert sample_inputs(FsspecStore(str(tmp_path)), "bare") is None
    (tmp_path / "bare" / "config.pbtxt").write_text('name: "bare"\n')
    assert sample_inputs(FsspecStore(str(tmp_path)), "bare") is None


def test_every_option_of_up_is_a_field_of_its_options() -> None:
    import dataclasses
    import inspect

    from octacloud.cli.up import up
    from octacloud.cli.up_options import UpOptions

    assert [f.name for f in dataclasses.fields(UpOptions)] == list(inspect.signature(up).parameters)


def test_gateway_workers_are_not_negative(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from octacloud.cli.main import app

    result = CliRunner().invoke(app, ["up", "--repository", str(tmp_path), "--gateway-workers", "-1"])
    assert result.exit_code == 2
    assert "--gateway-workers must be 0 (the cloud's own process) or more, got -1" in result.output


@pytest.mark.parametrize(
    ("name", "value"), [("OCTACLOUD_GATEWAY_SPIN_US", "soon"), ("OCTACLOUD_REPLICA_SPIN_US", "-1")]
)
def test_a_bad_spin_window_is_named_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    from typer.testing import CliRunner

    from octacloud.cli.main import app

    monkeypatch.setenv(name, value)
    result = CliRunner().invoke(app, ["up", "--repository", str(tmp_path), "--state-dir", str(tmp_path / "var")])
    assert result.exit_code == 2
    assert name in result.output and f"got {value}" in result.output.replace("'", "")
    assert not (tmp_path / "var").exists()
    if name == "OCTACLOUD_REPLICA_SPIN_US":  # a replica started by hand says the same
        serve = CliRunner().invoke(app, ["serve", "--repository", str(tmp_path)])
        assert serve.exit_code == 2 and name in serve.output


def test_up_says_what_keeps_running_and_what_it_adopted() -> None:
    running = [Replica("a-1", "a", handle="11"), Replica("a-2", "a", handle="12"), Replica("b-1", "b", handle="13")]
    said = left_running([*running, Replica("c-1", "c")], Path("var"))
    octacloud = as_typed("octacloud")  # as the user types it: .venv/bin/octacloud from the checkout
    assert said == (f"octacloud stopped; 3 replica(s) keep running (a × 2, b × 1): `{octacloud} up --state-dir var` "
                    f"adopts them, `{octacloud} down --state-dir var` stops them")  # fmt: skip
    assert left_running([Replica("c-1", "c")], Path("var")) == "octacloud stopped; no replica keeps running"

    before = [*running, stopped_by_down(Replica("d-1", "d", "n0", (0,), 125, handle="14"))]
    now = [running[0], Replica("a-2", "a", state=ReplicaState.FAILED), running[2], Replica("d-1", "d")]
    assert adopted(before, now) == ("adopted 2 running replica(s) (a × 1, b × 1); 1 had stopped since and start "
                                    "again (a × 1); 1 stopped by `octacloud down` start again (d × 1)")  # fmt: skip
    assert adopted([], [Replica("new-1", "new", handle="9")]) == ""  # a first start adopts nothing
