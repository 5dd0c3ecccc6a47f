"""Generative models: a maintained engine (llama.cpp's llama-server) per loaded version, supervised by the
replica, with what octacloud adds around it: the engine's arguments and memory in the slice's budget, the
context check before a request queues, and the measures of the stream (docs/llm.md)."""

from __future__ import annotations

from typing import Any


def generative_runtimes() -> dict[str, Any]:
    """Runtime factories of the generative backends, by the ``backend`` name a config gives."""
    from octacloud.serving.generate.version import LlamaCppFactory

    factory = LlamaCppFactory()
    return {factory.backend: factory}
