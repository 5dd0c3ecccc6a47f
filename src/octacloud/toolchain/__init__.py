"""Model toolchain: convert PyTorch / Hugging Face / ONNX models into served, versioned ONNX variants.

Import-light on purpose: importing this package (e.g. to read a profile) loads neither numpy, onnxruntime
nor torch. The heavy parts live in submodules, imported where they are used:

- :mod:`.profile`     the per-model profile schema and reader (stdlib only) — re-exported here;
- :mod:`.convert`     the pipeline: export → optimise → fp16/int8 → parity → profile → publish;
- :mod:`.sources`     what convert starts from (:mod:`.huggingface`, :mod:`.torchsource` import torch);
- :mod:`.variants`    fp16 conversion, int8 dynamic/static quantization;
- :mod:`.parity`      comparing a variant with the source framework; tolerances;
- :mod:`.profiling`   measuring weights, bytes per sample, latency and throughput vs batch size;
- :mod:`.repository`  Triton-layout repository: config.pbtxt, versions, atomic publishing;
- :mod:`.examples`    the example repository (``octacloud models build``).

See ``docs/toolchain.md``.
"""

from octacloud.toolchain.profile import BatchMeasurement, ModelProfile, read_profile

__all__ = ["BatchMeasurement", "ModelProfile", "read_profile"]
