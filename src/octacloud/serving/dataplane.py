"""The DataPlane: every protocol front end (REST, gRPC, the gateway) calls this one object.

It resolves the model version, checks the request against the model's config (each error names the input,
its shape or datatype), queues it on the model's dynamic batcher, and builds the response.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from tritonclient.grpc import model_config_pb2 as mc

from octacloud import __version__
from octacloud.serving.classification import class_count, classify
from octacloud.serving.errors import InvalidInputError, ModelNotFoundError, ModelNotReadyError
from octacloud.serving.generate.stats import GenerationStats
from octacloud.serving.generate.version import GenerativeVersion
from octacloud.serving.model import ModelState, ModelVersion
from octacloud.serving.repository.repository import ModelRepository, RepositoryEntry
from octacloud.serving.stats import ModelStats
from octacloud.serving.types import (
    InferenceRequest,
    InferenceResponse,
    ModelMetadata,
    RequestedOutput,
    ServerMetadata,
    Tensor,
    datatype_of,
)

SERVER_NAME = "octacloud"
EXTENSIONS = (
    "binary_tensor_data",
    "classification",
    "model_configuration",
    "model_repository",
    "parameters",
    "schedule_policy",
    "statistics",
)


@dataclass(frozen=True, slots=True)
class VersionStats:
    name: str
    version: str
    stats: ModelStats
    pending: int
    cold_start: Mapping[str, float] = field(default_factory=dict)
    """Seconds the version's start took, by part (``fetch`` from the model store, ``load``, ``warmup``)."""
    generation: GenerationStats | None = None
    """A generative version's measures (tokens, time to first token, KV cache); None for other models."""


class DataPlane:
    """Protocol-agnostic serving logic over one :class:`ModelRepository`."""

    def __init__(self, repository: ModelRepository) -> None:
        self.repository = repository
        self.ready = False

    # ---- health and metadata -----------------------------------------------------------------------------
    def live(self) -> bool:
        return True

    def server_ready(self) -> bool:
        return self.ready

    def server_metadata(self) -> ServerMetadata:
        return ServerMetadata(SERVER_NAME, __version__, EXTENSIONS)

    def model_ready(self, name: str, version: str = "") -> bool:
        try:
            return self.repository.get(name, version).state is ModelState.READY
        except (ModelNotFoundError, ModelNotReadyError):
            return False

    def model_metadata(self, name: str, version: str = "") -> ModelMetadata:
        model = self.repository.get(name, version)
        versions = tuple(m.version for m in self.repository.versions(name))
        return ModelMetadata(model.name, versions, model.config.platform, model.inputs, model.outputs)

    def model_config(self, name: str, version: str = "") -> mc.ModelConfig:
        config: mc.ModelConfig = self.repository.get(name, version).config
        return config

    def model_statistics(self, name: str = "", version: str = "") -> list[VersionStats]:
        if not name:
            models = self.repository.loaded()
        elif version:
            models = [self.repository.get(name, version)]
        else:
            self.repository.get(name)
            models = self.repository.versions(name)
        return [
            VersionStats(m.name, m.version, m.stats, m.batcher.pending, m.cold_start, getattr(m, "generation", None))
            for m in models
        ]

    # ---- repository extension ----------------------------------------------------------------------------
    def repository_index(self, ready_only: bool = False) -> list[RepositoryEntry]:
        return self.repository.index(ready_only)

    async def load(self, name: str) -> None:
        await self.repository.load(name)

    async def unload(self, name: str) -> None:
        await self.repository.unload(name)

    # ---- generation and embeddings -----------------------------------------------------------------------
    def generative(self, name: str, version: str = "") -> GenerativeVersion:
        """The READY version of a generative model; 400 for a model that does not generate text."""
        model = self.repository.get(name, version)
        if not isinstance(model, GenerativeVersion):
            raise InvalidInputError(
                f"model {name!r} is not a generative model (its backend is {model.config.backend!r}); ask it with "
                "/v2/models/<model>/infer, or for embeddings with /v1/embeddings"
            )
        return model

    async def embed(self, name: str, texts: list[str], tenant: str = "") -> tuple[list[npt.NDArray[Any]], int]:
        """Embeddings of ``texts`` by a text model (one that takes raw text and has one 2-D float output), and
        the tokens they took (the tokenizer's, truncated as the model reads them)."""
        model = self.repository.get(name)
        vector = [o for o in model.outputs if o.datatype in ("FP32", "FP16") and len(o.shape) == 2]
        if model.text is None or len(vector) != 1 or isinstance(model, GenerativeVersion):
            raise InvalidInputError(
                f"model {name!r} does not make embeddings: /v1/embeddings needs a text model (a tokenizer in its "
                "config) with one [batch, dimensions] output"
            )
        if not texts or any(not t for t in texts):
            raise InvalidInputError("input must hold at least one non-empty text")
        data = np.array([t.encode() for t in texts], dtype=object).reshape(len(texts), 1)
        request = InferenceRequest(name, [Tensor(model.text.name, "BYTES", data.shape, data)], tenant=tenant,
                                   outputs=[RequestedOutput(vector[0].name)])  # fmt: skip
        response = await self.infer(request)
        tokens = sum(len(e.ids) - e.attention_mask.count(0) for e in model.text.tokenizer.encode_batch(texts))
        out = response.outputs[0].data
        return [np.asarray(out[i], dtype=np.float32) for i in range(len(texts))], tokens

    # ---- inference ---------------------------------------------------------------------------------------
    async def infer(self, request: InferenceRequest) -> InferenceResponse:
        start = time.perf_counter_ns()
        model = self.repository.get(request.model, request.version)
        model.acquire()
        ok = False
        try:
            if model.text is not None:
                request = model.text.translate(request)
            inputs, rows = check_inputs(model, request)
            wanted = [o.name for o in request.outputs]
            for o in wanted:
                if o not in model.output_names:
                    raise InvalidInputError(
                        f"model {model.name!r} has no output {o!r}; its outputs are: {', '.join(model.output_names)}"
                    )
            classes = {o.name: k for o in request.outputs if (k := class_count(o.name, o.parameters)) is not None}
            results = await model.infer(inputs, rows, request.priority, request.timeout_us, request.tenant)
            names = wanted or model.output_names
            batched = model.max_batch_size > 0
            outputs = [
                classify(n, results[n], classes[n], batched, model.labels) if n in classes else _tensor(n, results[n])
                for n in names
            ]
            ok = True
            return InferenceResponse(model.name, model.version, outputs, request.id)
        finally:
            model.release()
            model.stats.on_request(ok, time.perf_counter_ns() - start)


def _tensor(name: str, array: npt.NDArray[Any]) -> Tensor:
    return Tensor(name, datatype_of(array.dtype), array.shape, array)


def check_inputs(model: ModelVersion, request: InferenceRequest) -> tuple[dict[str, npt.NDArray[Any]], int]:
    """The request's arrays by name and its batch size, or an :class:`InvalidInputError` naming the problem."""
    specs = model.input_specs
    arrays: dict[str, npt.NDArray[Any]] = {}
    rows = -1
    batching = model.max_batch_size > 0
    for t in request.inputs:
        spec = specs.get(t.name)
        if spec is None:
            raise InvalidInputError(f"model {model.name!r} has no input {t.name!r}; its inputs are: {', '.join(specs)}")
        if t.name in arrays:
            raise InvalidInputError(f"input {t.name!r} is given twice")
        if t.datatype != spec.datatype:
            raise InvalidInputError(
                f"input {t.name!r}: datatype {t.datatype} does not match the model's {spec.datatype}"
            )
        shape = t.shape
        if len(shape) != len(spec.shape) or any(d != s and s != -1 for d, s in zip(shape, spec.shape, strict=False)):
            raise InvalidInputError(
                f"input {t.name!r}: shape {list(shape)} does not match the model's {list(spec.shape)}"
                + (" (the first dim is the batch)" if batching else "")
            )
        if batching:
            if shape[0] < 1:
                raise InvalidInputError(f"input {t.name!r}: batch size must be >= 1, got {shape[0]}")
            if rows not in (-1, shape[0]):
                raise InvalidInputError(
                    f"input {t.name!r}: batch size {shape[0]} differs from the other inputs' {rows}"
                )
            rows = shape[0]
        arrays[t.name] = t.data
    if len(arrays) != len(specs):
        missing = [s for s in specs.values() if s.name not in arrays and not s.optional]
        if missing:
            raise InvalidInputError(
                f"model {model.name!r} needs input(s) "
                + ", ".join(f"{s.name!r} ({s.datatype} {list(s.shape)})" for s in missing)
            )
    return arrays, max(rows, 1)
