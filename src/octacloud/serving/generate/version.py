"""A loaded version of a generative model: its engine process, what it may hold, and what it measured.

It is a :class:`~octacloud.serving.model.ModelVersion` like any other (the repository loads, lists, swaps and
unloads it; statistics and readiness read the same), whose runtime is the engine: an unload waits for the
streams in flight (each holds the version as a request does) before the engine stops, so a rolling update lets
streams finish. Generation itself goes through :meth:`GenerativeVersion.open` (``serving/generate/session.py``);
OIP inference (``text_input`` → ``text_output``, as Triton's vLLM backend) runs one completion per request.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from tritonclient.grpc import model_config_pb2 as mc

from octacloud.core.clock import Clock
from octacloud.serving.errors import InvalidInputError, ModelConfigError, ModelExecutionError
from octacloud.serving.generate.args import EngineArgs, ModelShape, engine_args_for
from octacloud.serving.generate.engine import LlamaServer, find_llama_server
from octacloud.serving.generate.stats import GenerationStats
from octacloud.serving.generate.tokens import TemplateCost, measure_template
from octacloud.serving.memory import MEMORY_ENV, MemoryProbe, gpu_free_bytes
from octacloud.serving.model import ModelState, ModelVersion
from octacloud.serving.providers import gpu_visible
from octacloud.serving.runtime import Arrays, RuntimeFactory
from octacloud.serving.types import TensorMetadata

TEXT_INPUT = "text_input"
SAMPLING_INPUT = "sampling_parameters"
TEXT_OUTPUT = "text_output"
INFER_DEFAULT_MAX_TOKENS = 16
"""Tokens an OIP inference generates when its ``sampling_parameters`` say nothing (Triton's vLLM backend: 16)."""


class EngineRuntime:
    """The :class:`~octacloud.serving.runtime.ModelRuntime` of a generative model: OIP inference as one
    completion per request, over the engine's socket (called from the version's worker threads)."""

    couples_rows = False

    def __init__(self, engine: LlamaServer, timeout_s: float = 600.0) -> None:
        self.engine = engine
        self.timeout_s = timeout_s
        self._inputs = (TensorMetadata(TEXT_INPUT, "BYTES", (1,)), TensorMetadata(SAMPLING_INPUT, "BYTES", (1,)))
        self._outputs = (TensorMetadata(TEXT_OUTPUT, "BYTES", (1,)),)

    @property
    def inputs(self) -> Sequence[TensorMetadata]:
        return self._inputs

    @property
    def outputs(self) -> Sequence[TensorMetadata]:
        return self._outputs

    @property
    def device(self) -> str:
        return "cuda" if has_gpu() else "cpu"

    def run(self, inputs: Arrays, outputs: Sequence[str]) -> dict[str, npt.NDArray[Any]]:
        prompt = _text(inputs.get(TEXT_INPUT), TEXT_INPUT)
        raw = inputs.get(SAMPLING_INPUT)
        params: dict[str, Any] = {}
        if raw is not None and _text(raw, SAMPLING_INPUT).strip():
            try:
                params = json.loads(_text(raw, SAMPLING_INPUT))
            except ValueError as e:
                raise InvalidInputError(f"input {SAMPLING_INPUT!r} must be a JSON object: {e}") from None
            if not isinstance(params, dict):
                raise InvalidInputError(f"input {SAMPLING_INPUT!r} must be a JSON object")
        payload = {"prompt": prompt, "max_tokens": params.pop("max_tokens", INFER_DEFAULT_MAX_TOKENS), **params}
        status, answer = self._post("/v1/completions", payload)
        if status != 200 or not isinstance(answer, dict):
            raise ModelExecutionError(f"the engine answered {status}: {answer}")
        text = answer["choices"][0]["text"]
        return {TEXT_OUTPUT: np.array([text.encode()], dtype=object)}

    def _post(self, path: str, payload: object) -> tuple[int, object]:
        conn = _UnixConnection(str(self.engine.socket), self.timeout_s)
        try:
            headers = {"Authorization": self.engine.auth[1].decode(), "Content-Type": "application/json"}
            conn.request("POST", path, json.dumps(payload), headers)
            response = conn.getresponse()
            body = response.read()
        except OSError as e:
            raise ModelExecutionError(f"the engine did not answer: {e}") from None
        finally:
            conn.close()
        try:
            return response.status, json.loads(body)
        except ValueError:
            return response.status, body.decode(errors="replace")

    def close(self) -> None:
        """The engine is stopped by :meth:`GenerativeVersion.unload` (on the event loop)."""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


def _text(array: npt.NDArray[Any] | None, name: str) -> str:
    if array is None or array.size != 1:
        raise InvalidInputError(f"input {name!r} must hold exactly one string")
    value = array.reshape(-1)[0]
    try:
        return value.decode() if isinstance(value, bytes | bytearray) else str(value)
    except UnicodeDecodeError:
        raise InvalidInputError(f"input {name!r} is not UTF-8 text") from None


def generative_config(config: mc.ModelConfig, parallel: int) -> mc.ModelConfig:
    """``config`` completed for serving: ``text_input`` (+ optional ``sampling_parameters``) → ``text_output``,
    no batch dimension (the engine batches), one instance per engine slot (OIP inferences run side by side)."""
    done = mc.ModelConfig()
    done.CopyFrom(config)
    if done.max_batch_size:
        raise ModelConfigError(
            f"max_batch_size must be 0 for a {config.backend} model: its engine batches sequences itself "
            "(set parallel in model.json)"
        )
    done.ClearField("input")
    done.ClearField("output")
    done.input.add(name=TEXT_INPUT, data_type=mc.TYPE_STRING, dims=[1])
    done.input.add(name=SAMPLING_INPUT, data_type=mc.TYPE_STRING, dims=[1], optional=True)
    done.output.add(name=TEXT_OUTPUT, data_type=mc.TYPE_STRING, dims=[1])
    done.ClearField("instance_group")
    done.instance_group.add(count=parallel, kind=mc.ModelInstanceGroup.KIND_MODEL)
    done.ClearField("dynamic_batching")
    return done


def has_gpu() -> bool:
    """Whether this replica computes on a GPU: its slice names one and NVML sees it."""
    return gpu_visible() and gpu_free_bytes() is not None


def memory_budget() -> int | None:
    """The replica's memory budget in bytes (``$OCTACLOUD_MEMORY_BYTES``, its slice's share), None if unset."""
    value = os.environ.get(MEMORY_ENV, "")
    return int(value) if value.isdigit() and int(value) > 0 else None


class GenerativeVersion(ModelVersion):
    """See the module docstring. Create with :meth:`load`."""

    engine: LlamaServer
    args: EngineArgs
    shape: ModelShape
    generation: GenerationStats
    template_cost: TemplateCost | None = None
    """What the chat template adds to a prompt (measured at load; None for a model without one)."""

    @classmethod
    async def load(
        cls,
        name: str,
        version: str,
        version_dir: Path,
        config: mc.ModelConfig,
        factory: RuntimeFactory,
        threads: int,
        *,
        clock: Clock | None = None,
        probe: MemoryProbe | None = None,
    ) -> ModelVersion:
        """Check the engine arguments against the model and the slice's memory, start the engine, READY on
        return; :class:`ModelConfigError` naming what does not fit or why the engine did not start."""
        args, shape = engine_args_for(version_dir, config)
        full = generative_config(config, args.parallel)
        budget = memory_budget()
        need = args.memory_bytes(shape)
        if budget is not None and need > budget:
            raise ModelConfigError(
                f"version {version}: the engine needs {args.describe_memory(shape)} but the slice gives "
                f"{budget / 2**20:.0f} MiB; lower 'parallel' or 'context_length' in model.json, or deploy it on "
                "more octants"
            )
        gpu = has_gpu()
        flags = args.argv(version_dir.resolve() / args.model, alias=name, threads=threads, gpu=gpu)
        engine = LlamaServer(find_llama_server(), flags, f"model {name!r} version {version}")
        await engine.start()
        try:
            model = cls(name, version, full, EngineRuntime(engine), threads, clock=clock, probe=probe,
                        instances=args.parallel)  # fmt: skip
        except BaseException:
            await engine.stop()
            raise
        model.engine, model.args, model.shape = engine, args, shape
        model.generation = GenerationStats(args.parallel * args.context_length, args.parallel)
        try:
            model.template_cost = await measure_template(engine)
        except (InvalidInputError, ModelExecutionError):  # no chat template: every chat prompt is counted exactly
            model.template_cost = None
        model.batcher.start()
        model.state = ModelState.READY
        return model

    @property
    def context_length(self) -> int:
        return self.args.context_length

    async def unload(self) -> None:
        """Let the streams and inferences in flight finish, then stop the engine."""
        if self.state is ModelState.UNAVAILABLE:
            return
        await super().unload()
        await self.engine.stop()


class LlamaCppFactory:
    """The runtime factory of ``backend: "llama.cpp"``: its versions load as :class:`GenerativeVersion`."""

    platform = "llama.cpp_gguf"
    backend = "llama.cpp"
    version_class = GenerativeVersion

    def __call__(self, version_dir: Path, config: mc.ModelConfig, threads: int) -> EngineRuntime:
        raise ModelConfigError("a llama.cpp model loads through GenerativeVersion.load, not as a batch runtime")
