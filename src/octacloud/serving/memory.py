"""Free memory where a replica computes, and a model's per-sample footprint (for the batch cap).

The batch cap is ``min(max_batch_size, floor(free_memory / bytes_per_sample))``. The divisor is what one more
sample in a batch costs (its inputs, outputs and activations), not the model's size: the weights are paid once
when the model loads, whatever the batch, so dividing free memory by the model size answers "how many more
copies of the model fit", which is not the question a batcher asks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from octacloud.serving.types import TensorMetadata, element_size

MEMORY_ENV = "OCTACLOUD_MEMORY_BYTES"
"""The replica's memory budget in bytes (its GPU slice's share); unset: what the device says is free."""

BYTES_ELEMENT_GUESS = 64
"""Bytes assumed per element of a BYTES (string) tensor when estimating a sample's size."""

MemoryProbe = Callable[[], int]
"""Returns the bytes free for batches right now."""


def host_available_bytes() -> int:
    """``MemAvailable`` of /proc/meminfo (falls back to a large number where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 40


def gpu_free_bytes() -> int | None:
    """Free memory of the first visible GPU by NVML, or None without one."""
    try:
        import pynvml

        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
        handle = (
            pynvml.nvmlDeviceGetHandleByIndex(int(visible))
            if visible.isdigit()
            else pynvml.nvmlDeviceGetHandleByUUID(visible)
        )
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).free)
    except Exception:
        return None


def default_probe(device: str) -> MemoryProbe:
    """The probe for a runtime on ``device``: the budget in ``$OCTACLOUD_MEMORY_BYTES`` if set, capped by
    what the device has free."""
    budget = int(os.environ.get(MEMORY_ENV, "0") or 0)

    def probe() -> int:
        free = (gpu_free_bytes() if device.startswith("cuda") else None) or host_available_bytes()
        return min(free, budget) if budget > 0 else free

    return probe


def resident_bytes(pid: int | str = "self") -> int:
    """The resident set size of process ``pid`` (default: this one); 0 when it cannot be read (gone)."""
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def io_bytes_per_sample(tensors: Sequence[TensorMetadata], batch_dims: int) -> int:
    """Bytes of one sample's inputs and outputs (dynamic dims counted as 1): a floor for the footprint."""
    total = 0
    for t in tensors:
        n = 1
        for d in t.shape[batch_dims:]:
            n *= max(1, d)
        total += n * (element_size(t.datatype) or BYTES_ELEMENT_GUESS)
    return total


PROFILE_FILE = "profile.json"


def profile_bytes_per_sample(version_dir: Path) -> int | None:
    """``bytes_per_sample`` of the toolchain's ``<version>/profile.json``, if there is a valid one."""
    path = version_dir / PROFILE_FILE
    try:
        value = json.loads(path.read_text()).get("bytes_per_sample")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
