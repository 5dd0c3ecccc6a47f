"""Dynamic batching: a pure policy (:mod:`.policy`) and an asyncio mechanism around a model (:mod:`.batcher`)."""

from octacloud.serving.batching.batcher import BatchObserver, BatchRunner, DynamicBatcher
from octacloud.serving.batching.policy import BatchingSettings, BatchPolicy, Decision, Pending, QueuePolicy

__all__ = [
    "BatchObserver",
    "BatchPolicy",
    "BatchRunner",
    "BatchingSettings",
    "Decision",
    "DynamicBatcher",
    "Pending",
    "QueuePolicy",
]
