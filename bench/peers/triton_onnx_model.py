# Triton python-backend model wrapping onnxruntime: the Triton peer of bench/serving.py.
# bench/serving.py copies this file to <repo>/<model>/1/model.py with a first line that puts the peer venv's
# site-packages on sys.path (the python backend stub ignores PYTHONPATH). Like Triton's own backends, `execute`
# receives the batch the dynamic batcher formed: it concatenates the requests, runs one session, splits.
import json
import os

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.inputs = [i["name"] for i in config["input"]]
        self.outputs = [o["name"] for o in config["output"]]
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(os.environ.get("OCTACLOUD_BENCH_THREADS", "1"))
        options.inter_op_num_threads = 1
        path = os.path.join(args["model_repository"], args["model_version"], "model.onnx")
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])

    def execute(self, requests):
        arrays = [[pb_utils.get_input_tensor_by_name(r, n).as_numpy() for n in self.inputs] for r in requests]
        rows = [a[0].shape[0] for a in arrays]
        feed = {n: np.concatenate([a[i] for a in arrays]) for i, n in enumerate(self.inputs)}
        results = self.session.run(self.outputs, feed)
        responses, start = [], 0
        for r in rows:
            tensors = [pb_utils.Tensor(n, out[start : start + r]) for n, out in zip(self.outputs, results, strict=True)]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            start += r
        return responses
