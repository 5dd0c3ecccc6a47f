"""One tenant's inputs never change another's int8 results, and int8 models still batch.

``quantize_dynamic`` writes ``DynamicQuantizeLinear``, which computes one activation scale over the whole batch:
batched with a tenant's large inputs, another tenant's int8 results changed (200 of 200, sign flips). The
toolchain now gives every row its own scale (toolchain/rowscales.py), so its int8 models batch and a request's
result is the same alone or next to anyone's. A graph that still computes per-batch scales is found from its
structure and its requests never share a batch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from octacloud.protocols.grpc.h2 import CallContext
from octacloud.protocols.grpc.servicer import InferenceServicer
from octacloud.protocols.internal import TENANT_HEADER
from octacloud.protocols.rest.app import RestApp
from octacloud.serving import ControlMode, DataPlane, InferenceRequest, InferenceResponse, ModelRepository, Tensor
from octacloud.serving.batching.policy import BatchingSettings, BatchPolicy, Pending
from octacloud.serving.compute import ComputeProcess
from octacloud.serving.errors import ModelConfigError
from octacloud.serving.onnxops import couples_rows, op_types, row_coupling

MODELS = Path(os.environ.get("OCTACLOUD_MODELS", Path(__file__).resolve().parents[2] / "models"))


def latest(name: str) -> Path:
    """The newest version's model file of ``name`` in the example repository (skips when absent)."""
    versions = sorted((p for p in (MODELS / name).glob("*") if p.name.isdigit()), key=lambda p: int(p.name))
    if not versions or not (versions[-1] / "model.onnx").is_file():
        pytest.skip(f"the example model repository lacks {name} at {MODELS}: run `make models`")
    return versions[-1] / "model.onnx"


def per_batch_scales(tmp_path: Path, compute: str = "replica") -> Path:
    """A repository holding ``mlp_pt``: the example MLP as ``quantize_dynamic`` writes it (per-batch scales),
    computed where ``compute`` says (the config parameter)."""
    quantization = pytest.importorskip("onnxruntime.quantization")
    pytest.importorskip("onnx")
    fp32 = latest("mlp")
    root = tmp_path / "repo"
    (root / "mlp_pt" / "1").mkdir(parents=True)
    config = (MODELS / "mlp" / "config.pbtxt").read_text().replace('name: "mlp"', 'name: "mlp_pt"')
    config += f'\nparameters {{ key: "compute" value {{ string_value: "{compute}" }} }}\n'
    (root / "mlp_pt" / "config.pbtxt").write_text(config)
    quantization.quantize_dynamic(
        str(fp32), str(root / "mlp_pt" / "1" / "model.onnx"), weight_type=quantization.QuantType.QInt8
    )
    return root


def request(model: str, x: np.ndarray) -> InferenceRequest:
    return InferenceRequest(model, [Tensor("input", "FP32", x.shape, x)])


def test_row_coupling_is_read_from_the_graph_not_the_name(tmp_path: Path) -> None:
    assert {"DynamicQuantizeLinear", "MatMulInteger"} & op_types(latest("mlp_int8")) == {"MatMulInteger"}
    for name in ("mlp", "mlp_int8", "minilm_int8", "resnet50_int8"):  # resnet50_int8: static QDQ scales
        assert not couples_rows(latest(name)), (name, row_coupling(latest(name)))
    coupled = per_batch_scales(tmp_path) / "mlp_pt" / "1" / "model.onnx"
    assert any("DynamicQuantizeLinear" in why for why in row_coupling(coupled))
    renamed = tmp_path / "model.onnx"  # a dynamically quantized model under an innocent name
    shutil.copy(coupled, renamed)
    assert couples_rows(renamed)


def _graph(tmp_path: Path, name: str, nodes: list[object], inits: list[object], subgraph: bool = False) -> Path:
    onnx = pytest.importorskip("onnx")
    h = onnx.helper
    body = h.make_graph(nodes, name, [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 4])], [
        h.make_tensor_value_info("y", onnx.TensorProto.INT32, None)
    ], inits if not subgraph else [])  # fmt: skip
    if subgraph:  # the same nodes inside an If branch, the constants in the outer graph
        cond = h.make_tensor("cond", onnx.TensorProto.BOOL, [], [True])
        branch = h.make_graph(nodes, "then", [], [h.make_tensor_value_info("y", onnx.TensorProto.INT32, None)])
        node = h.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch)
        body = h.make_graph([node], name, list(body.input), list(body.output), [*inits, cond])
    path = tmp_path / f"{name}.onnx"
    onnx.save(h.make_model(body, opset_imports=[h.make_opsetid("", 20)]), str(path))
    return path


@pytest.mark.parametrize("subgraph", [False, True])
def test_an_integer_matmul_fed_a_zero_point_computed_at_run_time_couples_rows(tmp_path: Path, subgraph: bool) -> None:
    onnx = pytest.importorskip("onnx")
    h, T = onnx.helper, onnx.TensorProto
    w = h.make_tensor("w", T.INT8, [4, 2], [1] * 8)
    scale = h.make_tensor("scale", T.FLOAT, [], [0.1])
    zero = h.make_tensor("zero", T.UINT8, [], [128])
    quantize = h.make_node("QuantizeLinear", ["x", "scale", "zero"], ["q"])
    matmul = h.make_node("MatMulInteger", ["q", "w", "zero"], ["y"])
    static = _graph(tmp_path, "static", [quantize, matmul], [w, scale, zero], subgraph)
    assert not couples_rows(static), row_coupling(static)  # constant scale and zero point: rows independent
    # the zero point computed from the whole tensor (a hand-written per-batch quantization)
    lowest = h.make_node("ReduceMin", ["x"], ["lo"], keepdims=0)
    zp = h.make_node("Cast", ["lo"], ["zp"], to=T.UINT8)
    matmul_dynamic = h.make_node("MatMulInteger", ["q", "w", "zp"], ["y"])
    dynamic = _graph(tmp_path, "dynamic", [quantize, lowest, zp, matmul_dynamic], [w, scale, zero], subgraph)
    assert row_coupling(dynamic) == ["MatMulInteger's input 2 ('zp') is computed at run time"]
    scale_of_batch = h.make_node("ReduceMax", ["x"], ["s"], keepdims=0)
    quantize_dynamic = h.make_node("QuantizeLinear", ["x", "s", "zero"], ["q"])
    computed = _graph(tmp_path, "computed", [scale_of_batch, quantize_dynamic, matmul], [w, zero], subgraph)
    assert couples_rows(computed)


def test_an_isolating_policy_never_batches_two_requests() -> None:
    policy = BatchPolicy(BatchingSettings(max_batch_size=64, max_queue_delay_us=2000, isolate_requests=True))
    queue = [Pending(arrival=0.0, rows=2), Pending(arrival=0.0001, rows=1), Pending(arrival=0.0002, rows=1)]
    assert policy.decide(queue, now=0.0003, cap=64).batch == (0,)
    mixing = BatchPolicy(BatchingSettings(max_batch_size=64, max_queue_delay_us=2000))
    assert mixing.decide([*queue, Pending(arrival=0.0003)], now=0.0003, cap=64).batch == (0, 1, 2, 3)


async def _differing(dp: DataPlane, model: str, rounds: int, scale: float = 1000) -> tuple[int, int]:
    """(rounds where tenant A's result differed from its result alone, the largest batch run)."""
    rng = np.random.default_rng(7)
    a = rng.normal(size=(1, 256)).astype(np.float32)
    b = (rng.normal(size=(1, 256)) * scale).astype(np.float32)
    alone = (await dp.infer(request(model, a))).outputs[0].data
    differing = 0
    for _ in range(rounds):
        results = await asyncio.gather(dp.infer(request(model, a)), *(dp.infer(request(model, b)) for _ in range(7)))
        if not np.array_equal(results[0].outputs[0].data, alone):
            differing += 1
    stats = dp.repository.get(model).stats
    return differing, max(stats.batch_stats)


async def test_a_tenants_int8_results_do_not_depend_on_anothers_inputs_and_int8_batches() -> None:
    latest("mlp")
    latest("mlp_int8")
    repo = ModelRepository(MODELS, control_mode=ControlMode.EXPLICIT, threads=1)
    await repo.start(["mlp", "mlp_int8"])
    try:
        dp = DataPlane(repo)
        assert not repo.get("mlp_int8").isolates_requests and not repo.get("mlp").isolates_requests
        differing, largest = await _differing(dp, "mlp_int8", 100)
        assert differing == 0 and largest > 1  # batched with B's large inputs, A's results are bit-identical
        _, largest_fp32 = await _differing(dp, "mlp", 20)
        assert largest_fp32 > 1
    finally:
        await repo.close()


@pytest.mark.parametrize("compute", ["replica", "process"])
async def test_a_model_with_per_batch_scales_batches_only_within_one_tenant(tmp_path: Path, compute: str) -> None:
    """In the replica or in a compute child (which reports the graph's row coupling to the replica) alike."""
    root = per_batch_scales(tmp_path, compute)
    repo = ModelRepository(root, control_mode=ControlMode.EXPLICIT, threads=1)
    await repo.start(["mlp_pt"])
    try:
        dp = DataPlane(repo)
        model = repo.get("mlp_pt")
        assert isinstance(model.runtime, ComputeProcess) is (compute == "process")
        assert model.isolates_tenants and not model.isolates_requests
        assert await _differing(dp, "mlp_pt", 20) == (0, 1)  # tenant unknown (no gateway): every request alone
        rng = np.random.default_rng(5)
        a = rng.normal(size=(1, 256)).astype(np.float32)
        b = (rng.normal(size=(1, 256)) * 1000).astype(np.float32)
        alone = (await dp.infer(dataclasses.replace(request("mlp_pt", a), tenant="alice"))).outputs[0].data
        mixed = 0
        for _ in range(20):
            results = await asyncio.gather(
                *(dp.infer(dataclasses.replace(request("mlp_pt", a), tenant="alice")) for _ in range(4)),
                *(dp.infer(dataclasses.replace(request("mlp_pt", b), tenant="bob")) for _ in range(4)),
            )
            mixed += sum(not np.array_equal(r.outputs[0].data, alone) for r in results[:4])
        assert mixed == 0 and max(model.stats.batch_stats) > 1  # alice's requests batch together, never bob's
    finally:
        await repo.close()


class SpyDataPlane:
    """Records the tenant of every request the protocol adapters hand over."""

    def __init__(self) -> None:
        self.tenants: list[str] = []

    async def infer(self, request: InferenceRequest) -> InferenceResponse:
        self.tenants.append(request.tenant)
        zeros = np.zeros((1, 4), np.float32)
        return InferenceResponse(request.model, "1", [Tensor("OUTPUT0", "FP32", zeros.shape, zeros)], request.id)


async def _rest(app: RestApp, headers: list[tuple[bytes, bytes]]) -> int:
    body = b'{"inputs":[{"name":"INPUT0","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}]}'
    scope = {"type": "http", "method": "POST", "path": "/v2/models/add/infer", "headers": headers}
    sent: list[dict[str, object]] = []

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return int(str(sent[0]["status"]))


async def test_the_tenant_header_is_believed_only_behind_the_internal_secret() -> None:
    # Without the secret anyone can reach the replica and could claim a tenant to join its batches.
    claimed = [(TENANT_HEADER.encode(), b"alice")]
    for trusted, expected in ((True, "alice"), (False, "")):
        spy = SpyDataPlane()
        assert await _rest(RestApp(spy, trust_tenant=trusted), claimed) == 200  # type: ignore[arg-type]
        servicer = InferenceServicer(spy, trust_tenant=trusted)  # type: ignore[arg-type]
        message = pb.ModelInferRequest(model_name="add")
        message.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4]).contents.fp32_contents.extend([1, 2, 3, 4])
        await servicer.ModelInfer(message, CallContext(((TENANT_HEADER, "alice"),), "peer"))
        assert spy.tenants == [expected, expected]


async def test_batch_isolation_can_be_asked_for_and_a_wrong_value_is_refused(tmp_path: Path) -> None:
    latest("mlp_int8")
    root = tmp_path / "repo"
    for value in ("requests", "sometimes"):
        shutil.copytree(MODELS / "mlp_int8", root / f"mlp_{value}")
        config = root / f"mlp_{value}" / "config.pbtxt"
        config.write_text(
            config.read_text().replace('name: "mlp_int8"', f'name: "mlp_{value}"')
            + f'\nparameters {{ key: "batch_isolation" value {{ string_value: "{value}" }} }}\n'
        )
    repo = ModelRepository(root, control_mode=ControlMode.EXPLICIT, threads=1)
    await repo.start(["mlp_requests"])
    try:
        assert repo.get("mlp_requests").isolates_requests
        with pytest.raises(ModelConfigError, match="'batch_isolation' is 'sometimes'; choose one of"):
            await repo.load("mlp_sometimes")
    finally:
        await repo.close()


async def test_odd_and_malformed_requests_in_the_same_batch_do_not_change_the_others() -> None:
    latest("mlp_int8")
    repo = ModelRepository(MODELS, control_mode=ControlMode.EXPLICIT, threads=1)
    await repo.start(["mlp_int8"])
    try:
        dp = DataPlane(repo)
        a = np.random.default_rng(3).normal(size=(1, 256)).astype(np.float32)
        alone = (await dp.infer(request("mlp_int8", a))).outputs[0].data
        odd = [np.full((1, 256), v, np.float32) for v in (np.inf, -np.inf, np.nan, 3e38, 0.0)]
        for _ in range(10):
            results = await asyncio.gather(
                dp.infer(request("mlp_int8", a)),
                *(dp.infer(request("mlp_int8", x)) for x in odd),
                dp.infer(request("mlp_int8", np.ones((1, 255), np.float32))),  # a wrong shape: refused alone
                return_exceptions=True,
            )
            first = results[0]
            assert not isinstance(first, BaseException) and np.array_equal(first.outputs[0].data, alone)
            assert all(not isinstance(r, BaseException) for r in results[1:-1])
            assert isinstance(results[-1], Exception) and "256" in str(results[-1])
        assert max(repo.get("mlp_int8").stats.batch_stats) > 1
    finally:
        await repo.close()


def _text(length: int, seed: int) -> list[Tensor]:
    ids = np.random.default_rng(seed).integers(1000, 20000, size=(1, length)).astype(np.int64)
    ids[0, 0] = 101
    ones = np.ones_like(ids)
    return [
        Tensor("input_ids", "INT64", ids.shape, ids),
        Tensor("attention_mask", "INT64", ids.shape, ones),
        Tensor("token_type_ids", "INT64", ids.shape, ones * 0),
    ]


async def test_text_int8_batches_per_token_and_other_lengths_do_not_fail_the_batch() -> None:
    latest("minilm_int8")
    repo = ModelRepository(MODELS, control_mode=ControlMode.EXPLICIT, threads=1)
    await repo.start(["minilm_int8"])
    try:
        dp = DataPlane(repo)
        assert not repo.get("minilm_int8").isolates_requests
        mine = InferenceRequest("minilm_int8", _text(24, 0))
        alone = (await dp.infer(mine)).outputs[0].data
        for seed in range(1, 4):
            others = [InferenceRequest("minilm_int8", _text(24 if i % 2 else 40, seed * 10 + i)) for i in range(5)]
            results = await asyncio.gather(dp.infer(mine), *(dp.infer(r) for r in others))
            # onnxruntime's fp32 broadcasting Div rounds by batch shape (fp32 MiniLM too); per-batch scales
            # moved results by ~0.03
            np.testing.assert_allclose(results[0].outputs[0].data, alone, rtol=0, atol=1e-6)
        assert max(repo.get("minilm_int8").stats.batch_stats) > 1
    finally:
        await repo.close()


async def test_the_gateway_sends_the_verified_tenant_and_drops_a_clients_claim() -> None:
    import httpx

    from octacloud.tenancy.keys import ADMIN_TENANT
    from tests.reliability.harness import gateway

    gw = await gateway()  # no key store: every caller is the anonymous admin
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}") as client:
            await client.post("/v2/models/m/infer", content=b"x", headers={TENANT_HEADER: "victim"})
        [fake, _, _] = gw.replicas[0]
        seen = fake.seen[-1]["headers"]
        assert [v for k, v in seen if k == TENANT_HEADER.encode()] == [ADMIN_TENANT.encode()]
    finally:
        await gw.close()
