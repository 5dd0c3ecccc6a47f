"""The pieces of generative serving that need no engine: engine arguments and memory, server-sent events, and
a tenant's token and stream limits (on a manual clock)."""

from __future__ import annotations

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from octacloud.core.clock import ManualClock
from octacloud.serving.errors import ModelConfigError
from octacloud.serving.generate.args import EngineArgs, ModelShape
from octacloud.serving.generate.sse import EventSplitter, data_of
from octacloud.tenancy.keys import Quota
from octacloud.tenancy.tokens import GenerationLimits, OverLimitError

SMOLLM2 = ModelShape(weights_bytes=98_362_432, kv_elements_per_token=11_520, context_max=8192, vocab_size=49_152,
                     embedding_length=576)  # fmt: skip


def test_the_kv_cache_of_every_slot_is_counted_in_the_memory() -> None:
    args = EngineArgs(context_length=2048, parallel=8)
    assert args.kv_bytes_per_token(SMOLLM2) == 11_520 * 2  # f16: two bytes an element
    assert args.kv_cache_bytes(SMOLLM2) == 8 * 2048 * 23_040
    assert (
        EngineArgs(context_length=2048, parallel=8, cache_type_k="q8_0", cache_type_v="q8_0").kv_bytes_per_token(
            SMOLLM2
        )
        == 11_520 * 34 // 32
    )
    assert args.memory_bytes(SMOLLM2) > SMOLLM2.weights_bytes + args.kv_cache_bytes(SMOLLM2)


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ([], "JSON object"),
        ({"paralel": 4}, "unknown key"),
        ({"parallel": 0}, "positive integer"),
        ({"parallel": True}, "positive integer"),
        ({"model": "../x.gguf"}, "file in the version folder"),
        ({"cache_type_k": "f8"}, "cache_type_k"),
        ({"flash_attn": "yes"}, "flash_attn"),
        ({"ubatch_size": 1024, "batch_size": 512}, "ubatch_size"),
        ({"args": ["--port", "1"]}, "may not set ['--port']"),
        ({"args": ["--api-key=x"]}, "may not set ['--api-key']"),
        ({"args": "--mlock"}, "list of strings"),
    ],
)
def test_bad_engine_arguments_are_refused_naming_the_key(raw: object, says: str) -> None:
    with pytest.raises(ModelConfigError, match=says.replace("[", r"\[").replace("]", r"\]")):
        EngineArgs.parse(raw)


def test_a_context_over_the_trained_one_is_refused() -> None:
    with pytest.raises(ModelConfigError, match="over the 8192 tokens"):
        EngineArgs(context_length=9000).check_shape(SMOLLM2, "model.json")


def test_the_shape_comes_from_the_config_and_its_absence_says_how_to_publish() -> None:
    config = mc.ModelConfig(name="m", backend="llama.cpp")
    with pytest.raises(ModelConfigError, match="octacloud convert"):
        ModelShape.of(config)


def test_events_are_cut_whole_from_chunks_of_any_size() -> None:
    stream = b'data: {"a": 1}\n\ndata: {"b": 2}\r\n\r\n: ping\n\ndata: [DONE]\n\n'
    for size in (1, 3, 7, len(stream)):
        splitter = EventSplitter()
        events = [e for i in range(0, len(stream), size) for e in splitter.feed(stream[i : i + size])]
        assert [data_of(e) for e in events] == [{"a": 1}, {"b": 2}, None, None]
        assert splitter.rest == b""


def test_a_token_budget_admits_while_not_in_debt_and_settles_to_what_was_used() -> None:
    clock = ManualClock()
    limits = GenerationLimits(clock)
    quota = Quota(tokens_per_minute=600)
    first = limits.admit("t", quota, 500)
    second = limits.admit("t", quota, 500)  # 100 left: admitted, now 400 in debt
    with pytest.raises(OverLimitError) as caught:
        limits.admit("t", quota, 10)
    assert caught.value.retry_after == 41  # 401 tokens at 10 a second
    limits.settle(first, 50)
    limits.settle(second, 50)  # the estimates are replaced by what was used: 600 - 100
    assert limits.level("t") == pytest.approx(500)
    clock.advance(30)
    assert limits.level("t") == pytest.approx(600)  # one minute's worth at most
    limits.settle(limits.admit("t", quota, 0), 0)


def test_streams_in_flight_are_bounded_per_tenant_and_freed_when_they_end() -> None:
    limits = GenerationLimits(ManualClock())
    quota = Quota(max_streams=1)
    held = limits.admit("t", quota, 0)
    limits.settle(limits.admit("other", quota, 0), 0)  # another tenant has its own count
    with pytest.raises(OverLimitError, match="1 generation"):
        limits.admit("t", quota, 0)
    limits.settle(held, 0)
    assert limits.streams == {}
    limits.admit("t", quota, 0)
