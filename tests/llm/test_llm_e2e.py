"""End to end: the real SmolLM2-135M on llama.cpp's engine, served by a cloud and asked through its gateway with
the official ``openai`` client, as a user would.

One cloud for the module (the cluster tests' fleet of two 4 GiB CPU cards; one replica of ``smollm2`` on 4 octants,
owned by tenant ``alice``, and MiniLM as embeddings); each
test asks it something: a streamed chat, stop sequences and ``max_tokens``, a repeated seed, ``usage`` against
the ledger, a client that goes away mid-stream, another tenant, a context that cannot fit, garbage bodies,
Triton's generate extension, token and stream limits, and ``kill -9`` of the replica in the middle of a stream.

Needs the example repository's ``smollm2`` and ``minilm`` (``make models``) and the engine (``make llm``).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from octacloud.app import CloudConfig
from octacloud.control.controller import ControllerSettings
from octacloud.security.internal_auth import HEADER, REPLICA_HEADER
from octacloud.serving.errors import ModelConfigError
from octacloud.serving.generate.engine import find_llama_server

from ..cluster.test_cloud_e2e import CloudThread, wait_until

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.slow, pytest.mark.models]

MODELS = Path(os.environ.get("OCTACLOUD_MODELS", Path(__file__).resolve().parents[2] / "models"))
CHAT = [{"role": "user", "content": "Name three colours."}]


def _needs() -> None:
    for model in ("smollm2", "minilm"):
        if not (MODELS / model / "config.pbtxt").is_file():
            pytest.skip(f"the example model {model} is not built in {MODELS}: run `make models`")
    try:
        find_llama_server()
    except ModelConfigError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CloudThread]:
    _needs()
    root = tmp_path_factory.mktemp("llm")
    repo = root / "models"
    repo.mkdir()
    for model in ("smollm2", "minilm"):
        (repo / model).symlink_to((MODELS / model).resolve(), target_is_directory=True)
    config = CloudConfig(
        repository=repo,
        state_dir=root / "var",
        http_port=0,
        grpc_port=0,
        meter_interval_s=0.5,
        controller=ControllerSettings(interval_s=0.5, health_interval_s=0.2, backoff_base_s=0.2, stop_grace_s=5),
    )
    c = CloudThread(config)
    try:
        for tenant in ("alice", "bob"):
            assert c.admin("POST", "/tenants", {"name": tenant}).status_code == 201
        keys = {t: c.admin("POST", "/keys", {"tenant": t}).json()["key"] for t in ("alice", "bob")}
        c.keys = keys  # type: ignore[attr-defined]
        for model, octants in (("smollm2", 4), ("minilm", 2)):
            body = {"name": model, "model": model, "octants": octants, "tenant": "alice"}
            assert c.admin("POST", "/deployments", body).status_code == 201
        for model in ("smollm2", "minilm"):
            wait_until(f"{model} ready", lambda m=model: _ready(c, m), timeout=240)
        yield c
    finally:
        while OPEN_CLIENTS:
            OPEN_CLIENTS.pop().close()
        c.stop(stop_replicas=True)


def _ready(c: CloudThread, name: str) -> bool:
    return any(r["state"] == "ready" for r in c.deployment(name)["instances"])


OPEN_CLIENTS: list[Any] = []
"""The openai clients the tests made, closed with the cloud (their connection pools hold sockets)."""


def client(c: CloudThread, tenant: str = "alice", **options: Any) -> Any:
    made = openai.OpenAI(base_url=f"{c.url}/v1", api_key=c.keys[tenant], max_retries=0, **options)  # type: ignore[attr-defined]
    OPEN_CLIENTS.append(made)
    return made


def post(c: CloudThread, path: str, body: bytes | dict[str, Any], tenant: str = "alice") -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {c.keys[tenant]}", "Content-Type": "application/json"}  # type: ignore[attr-defined]
    return httpx.post(f"{c.url}{path}", content=data, headers=headers, timeout=120)


def test_the_openai_client_streams_a_chat_completion_with_its_usage(cloud: CloudThread) -> None:
    chunks = list(
        client(cloud).chat.completions.create(model="smollm2", messages=CHAT, max_tokens=12, stream=True, seed=1)
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert text.strip()
    assert len(usage) == 1 and usage[0].completion_tokens <= 12 and usage[0].prompt_tokens > 0
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2  # token by token, not whole


def test_max_tokens_and_stop_sequences_hold(cloud: CloudThread) -> None:
    api = client(cloud)
    short = api.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=3, temperature=0)
    assert short.usage.completion_tokens <= 3 and short.choices[0].finish_reason == "length"
    long = api.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=24, temperature=0)
    counted = long.choices[0].text
    assert " 7" in counted, counted  # the model counts on: a stop there must cut the text before it
    stopped = api.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=24, temperature=0, stop=[" 7"])
    assert stopped.choices[0].finish_reason == "stop"
    assert " 7" not in stopped.choices[0].text and counted.startswith(stopped.choices[0].text)


def test_a_fixed_seed_repeats_the_same_tokens(cloud: CloudThread) -> None:
    api = client(cloud)

    def ask(seed: int) -> str:
        answer = api.chat.completions.create(
            model="smollm2", messages=CHAT, max_tokens=16, temperature=1.0, top_p=0.95, seed=seed
        )
        return str(answer.choices[0].message.content)

    first = ask(1234)
    assert ask(1234) == first
    assert {ask(s) for s in (1, 2, 3)} != {first}  # other seeds sample otherwise


def test_usage_in_the_answers_is_what_the_ledger_bills(cloud: CloudThread) -> None:
    api = client(cloud)
    before = _gateway_tokens(cloud)  # what earlier tests sent, some of it perhaps not yet in a closed interval
    answers = [
        api.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=6),
        api.completions.create(model="smollm2", prompt="The sky is", max_tokens=5),
    ]
    streamed = list(api.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=7, stream=True))
    usages = [a.usage for a in answers] + [c.usage for c in streamed if c.usage is not None]
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    want = (before[0] + prompt, before[1] + completion)
    assert _gateway_tokens(cloud) == want  # the gateway counted what the answers said, token for token
    try:
        wait_until("the ledger to bill the tokens", lambda: _ledger_tokens(cloud) == want, timeout=30)
    except AssertionError:
        report = cloud.admin("GET", "/usage?tenant=alice").json()
        raise AssertionError(f"{_ledger_tokens(cloud)} != {want}: {report}") from None


def _gateway_tokens(c: CloudThread) -> tuple[int, int]:
    t = c.cloud.routes.tenant_traffic("alice", "smollm2")
    return t.prompt_tokens, t.completion_tokens


def _ledger_tokens(c: CloudThread) -> tuple[int, int]:
    report = c.admin("GET", "/usage?tenant=alice&by=deployment").json()
    line = next((x for x in report["lines"] if x["group"] == "smollm2"), {})
    return int(line.get("prompt_tokens", 0)), int(line.get("completion_tokens", 0))


def _replica_metric(c: CloudThread, name: str) -> float | None:
    """A metric of the smollm2 replica, read from its own metrics endpoint with the cloud's secret."""
    instance = next(r for r in c.deployment("smollm2")["instances"] if r["state"] == "ready")
    text = httpx.get(
        f"http://127.0.0.1:{instance['metrics_port']}/metrics",
        headers={HEADER: c.cloud.internal_secret, REPLICA_HEADER: instance["id"]},
        timeout=10,
    ).text
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_a_client_that_goes_away_mid_stream_stops_the_generation(cloud: CloudThread) -> None:
    aborted = _replica_metric(cloud, "octacloud_generation_aborted_total") or 0.0
    tokens = _replica_metric(cloud, "vllm:generation_tokens_total") or 0.0
    stream = client(cloud).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Write a long story."}], max_tokens=1500, stream=True
    )
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got == 3:
            break
    stream.close()  # the client goes away
    wait_until("the replica to count the abort", lambda: _replica_metric(cloud, "octacloud_generation_aborted_total")
               == aborted + 1, timeout=30)  # fmt: skip
    wait_until("no sequence left running", lambda: _replica_metric(cloud, "vllm:num_requests_running") == 0)
    generated = (_replica_metric(cloud, "vllm:generation_tokens_total") or 0.0) - tokens
    assert generated < 200, f"the engine went on generating for nobody: {generated} tokens"


def test_another_tenant_can_neither_see_nor_use_the_model(cloud: CloudThread) -> None:
    alice = {m.id for m in client(cloud).models.list()}
    bob = {m.id for m in client(cloud, "bob").models.list()}
    assert {"smollm2", "minilm"} <= alice and not bob & {"smollm2", "minilm"}
    with pytest.raises(openai.NotFoundError) as caught:
        client(cloud, "bob").chat.completions.create(model="smollm2", messages=CHAT, max_tokens=2)
    assert caught.value.body["code"] == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{cloud.url}/v1", api_key="oc_nope_nope", max_retries=0).models.list()


def test_a_context_that_cannot_fit_is_refused_before_it_queues(cloud: CloudThread) -> None:
    words = " ".join(["tokens"] * 2100)  # more than the 2,048 tokens of a sequence
    refused = _replica_metric(cloud, "octacloud_generation_context_refused_total") or 0.0
    with pytest.raises(openai.BadRequestError) as caught:
        client(cloud).chat.completions.create(model="smollm2", messages=[{"role": "user", "content": words}])
    assert caught.value.status_code == 400 and "maximum context length is 2048" in caught.value.message
    with pytest.raises(openai.BadRequestError):  # a short prompt, but more completion than the context holds
        client(cloud).completions.create(model="smollm2", prompt="Hi", max_tokens=2048)
    assert _replica_metric(cloud, "octacloud_generation_context_refused_total") == refused + 2


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b'"text"',
        b'{"model": "smollm2"}',
        b'{"model": "smollm2", "messages": "hi"}',
        b'{"model": "smollm2", "messages": [{"role": "wizard", "content": "x"}]}',
        b'{"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}',
        b'{"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "n": 99}',
        b'{"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
        b'{"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "id_slot": 3}',
        b'{"model": ["smollm2"], "messages": []}',
        b'{"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"a": 1}}',
    ],
)
def test_garbage_bodies_get_openai_shaped_4xx_never_5xx(cloud: CloudThread, body: bytes) -> None:
    answer = post(cloud, "/v1/chat/completions", body)
    assert 400 <= answer.status_code < 500, answer.text
    error = answer.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"


def test_the_generate_extension_answers_whole_and_streamed(cloud: CloudThread) -> None:
    ask = {"text_input": "The sky is", "parameters": {"max_tokens": 4}}
    whole = post(cloud, "/v2/models/smollm2/generate", ask)
    assert whole.status_code == 200, whole.text
    assert whole.json()["model_name"] == "smollm2" and whole.json()["text_output"]
    streamed = post(cloud, "/v2/models/smollm2/generate_stream", ask)
    events = [json.loads(line[5:]) for line in streamed.text.splitlines() if line.startswith("data:")]
    assert "".join(e["text_output"] for e in events) and events[-1]["usage"]["completion_tokens"] <= 4
    bad = post(cloud, "/v2/models/smollm2/generate", {"text_input": 3})
    assert bad.status_code == 400 and "text_input" in bad.json()["error"]


def test_minilm_answers_openai_embeddings(cloud: CloudThread) -> None:
    answer = client(cloud).embeddings.create(model="minilm", input=["A man is eating food.", "A cat sleeps."])
    assert [len(d.embedding) for d in answer.data] == [384, 384]
    assert answer.usage.prompt_tokens > 4
    with pytest.raises(openai.BadRequestError):
        client(cloud).embeddings.create(model="smollm2", input="not an embedding model")


def test_token_rate_and_stream_limits_refuse_with_retry_after(cloud: CloudThread) -> None:
    assert cloud.admin("POST", "/tenants/alice/quota", {"tokens_per_minute": 1}).status_code == 200
    try:
        # a deadline against a hang, not a timing: once the quota has reached the gateway's key cache (5 s), one
        # try takes an estimate of about 41 tokens from a bucket of 1 and leaves it in debt by what the completion
        # used, which 1 token a minute pays off in that many minutes: the next try is refused however slowly the
        # engine answers
        wait_until("the quota to reach the gateway", lambda: _over_budget(cloud), timeout=180)
        refused = post(cloud, "/v1/completions", {"model": "smollm2", "prompt": "Hi", "max_tokens": 40})
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_error"
    finally:
        cloud.admin("POST", "/tenants/alice/quota", {"tokens_per_minute": None})
    assert cloud.admin("POST", "/tenants/alice/quota", {"max_streams": 1}).status_code == 200
    try:
        wait_until("the stream limit to reach the gateway", lambda: _second_stream_refused(cloud), timeout=180)
    finally:
        cloud.admin("POST", "/tenants/alice/quota", {"max_streams": None})


def _over_budget(c: CloudThread) -> bool:
    """Spend the budget: true once a request is refused for it."""
    answer = post(c, "/v1/completions", {"model": "smollm2", "prompt": "Hi", "max_tokens": 40})
    return answer.status_code == 429


def _second_stream_refused(c: CloudThread) -> bool:
    holding = client(c).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Write a long story."}], max_tokens=300, stream=True
    )
    next(iter(holding))  # the first stream is in flight
    try:
        second = post(c, "/v1/chat/completions", {"model": "smollm2", "messages": CHAT, "max_tokens": 2})
    finally:
        holding.close()
    return second.status_code == 429 and "generation(s) in flight" in second.json()["error"]["message"]


def test_kill_9_of_the_replica_mid_stream_ends_the_stream_and_leaves_no_engine(cloud: CloudThread) -> None:
    instance = next(r for r in cloud.deployment("smollm2")["instances"] if r["state"] == "ready")
    engines = _engines_of(instance["pid"])
    assert engines, "the replica runs its engine as its child"
    stream = client(cloud).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Write a long story."}], max_tokens=1500, stream=True
    )
    streaming, broke = threading.Event(), threading.Event()

    def read() -> None:
        try:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    streaming.set()
        except Exception:
            pass
        broke.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert streaming.wait(60), "the stream did not start"
    os.kill(instance["pid"], signal.SIGKILL)
    assert broke.wait(60), "the client's stream did not end when its replica died"
    wait_until("the engine to die with its replica", lambda: not any(_alive(pid) for pid in engines), timeout=30)
    wait_until("a new replica", lambda: _ready(cloud, "smollm2") and _ready_pid(cloud) != instance["pid"], timeout=240)
    after = client(cloud).chat.completions.create(model="smollm2", messages=CHAT, max_tokens=3)
    assert after.choices[0].message.content


def _ready_pid(c: CloudThread) -> int | None:
    return next((r["pid"] for r in c.deployment("smollm2")["instances"] if r["state"] == "ready"), None)


def _engines_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                exe = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[0]
            except (OSError, IndexError):
                continue
            if int(stat[1]) == pid and exe.endswith(b"llama-server"):
                out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
