#!/usr/bin/env bash
# Set up the benchmark peers OUTSIDE the project: Triton's perf_analyzer and a real Triton Inference Server 2.51
# (from the nvidia-pytriton wheel, python backend). Idempotent: a step whose result is there is skipped.
#
#   bench/peers/setup.sh [perf_analyzer|triton|all]     (default: all)
#
# Cache: $OCTACLOUD_PEERS (default ~/.cache/octacloud-peers). Prints nothing else on success but the paths.
# Each peer's Python packages come from its lock file (requirements/peer-*.lock, made by `make lock`); a peer
# set up from another lock is installed again.
# docs/serving.md (the benchmark section) says what each peer is and how it is run.
set -euo pipefail
WHAT=${1:-all}
ROOT=${OCTACLOUD_PEERS:-$HOME/.cache/octacloud-peers}
PY=${PYTHON:-python3}
LOCKS=$(cd "$(dirname "$0")/../../requirements" && pwd)
mkdir -p "$ROOT"

setup_perf_analyzer() {
  local pa=$ROOT/perf_analyzer
  local bin=$pa/whl/tritonclient-2.51.0.data/data/bin/perf_analyzer
  if [ -x "$pa/run-perf_analyzer" ] && cmp -s "$LOCKS/peer-perf-analyzer.lock" "$pa/installed.lock" \
    && "$pa/run-perf_analyzer" --version >/dev/null 2>&1; then
    echo "perf_analyzer: $pa/run-perf_analyzer"; return
  fi
  if ! ldconfig -p | grep -q libb64.so.0d; then
    (apt-get install -y libb64-0d >/dev/null 2>&1) || (apt-get update >/dev/null && apt-get install -y libb64-0d >/dev/null)
  fi
  [ -x "$pa/bin/pip" ] || "$PY" -m venv "$pa"
  "$pa/bin/pip" install --quiet -r "$LOCKS/peer-perf-analyzer.lock"     # libcudart.so.12; loads without a GPU
  "$pa/bin/pip" download --quiet --no-deps tritonclient==2.51.0 -d "$pa/whl"
  (cd "$pa/whl" && unzip -qo tritonclient-2.51.0-*.whl 'tritonclient-2.51.0.data/*')
  local cudart
  cudart=$(echo "$pa"/lib/python3*/site-packages/nvidia/cuda_runtime/lib)
  cat >"$pa/run-perf_analyzer" <<WRAP
#!/usr/bin/env bash
export LD_LIBRARY_PATH=$cudart\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
exec $bin "\$@"
WRAP
  chmod +x "$pa/run-perf_analyzer"
  "$pa/run-perf_analyzer" --version >/dev/null
  cp "$LOCKS/peer-perf-analyzer.lock" "$pa/installed.lock"
  echo "perf_analyzer: $pa/run-perf_analyzer"
}

setup_triton() {
  local t=$ROOT/triton
  if [ -x "$t/run-tritonserver" ] && [ -x "$t/dist/backends/python/triton_python_backend_stub" ] \
    && cmp -s "$LOCKS/peer-triton.lock" "$t/installed.lock"; then
    echo "tritonserver: $t/run-tritonserver"; return
  fi
  [ -x "$t/bin/pip" ] || "$PY" -m venv "$t"
  "$t/bin/pip" install --quiet -r "$LOCKS/peer-triton.lock"
  local sp
  sp=$(echo "$t"/lib/python3*/site-packages)
  mkdir -p "$t/dist"
  cp -r "$sp"/pytriton/tritonserver/{bin,backends,caches} "$t/dist/"
  cp "$sp"/pytriton/tritonserver/python_backend_stubs/3.11/triton_python_backend_stub "$t/dist/backends/python/"
  cat >"$t/run-tritonserver" <<WRAP
#!/usr/bin/env bash
# tritonserver 2.51 with the python backend; pass --model-repository=... and the addresses.
export LD_LIBRARY_PATH=$sp/nvidia_pytriton.libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
exec $t/dist/bin/tritonserver --backend-directory=$t/dist/backends --cache-directory=$t/dist/caches "\$@"
WRAP
  chmod +x "$t/run-tritonserver"
  echo "$sp" >"$t/site-packages.txt"
  cp "$LOCKS/peer-triton.lock" "$t/installed.lock"
  echo "tritonserver: $t/run-tritonserver"
}

case "$WHAT" in
  perf_analyzer) setup_perf_analyzer ;;
  triton) setup_triton ;;
  all) setup_perf_analyzer; setup_triton ;;
  *) echo "usage: $0 [perf_analyzer|triton|all]" >&2; exit 2 ;;
esac
