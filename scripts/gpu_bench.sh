#!/usr/bin/env bash
# The engine against llama.cpp built with CUDA, same GGUF, same experts on the GPU (issue 46), on a
# GPU machine that reaches no package registry, in one run of about 8 minutes, build included.
#
# Here first (PyPI reachable), once per llama-cpp-python version:
#
#     python scripts/prepare_gpu_bench.py          # writes .gpu_bench/ (ignored by git), ~31 MiB
#
# Then on the device, with the run tool (one call; the working tree travels, .gpu_bench is carried):
#
#     run(command="bash scripts/gpu_bench.sh", carry=[".gpu_bench"], timeout_s=600)
#
# Expected: the build 4-5 minutes (estimated from 141 CUDA units: docs/gpu_bench.md), the GGUFs
# and the native kernels beside it, then both comparisons within the rest of BUDGET (480 s).
#
# What it does, timed into $OUT/timeline.txt:
#   1. builds libllama + libggml (CPU and CUDA backends) from .gpu_bench/llama.cpp for sm_90 only
#      (H100/H200), no common/tools/tests/examples/server, flash-attention kernels for an f16 cache
#      only, ninja -j$JOBS; llama-cpp-python's Python package (.gpu_bench/python) loads it through
#      LLAMA_CPP_LIB_PATH. A folder .gpu_bench/llama-cuda-lib holding libllama.so (a previous run's
#      $OUT/llama-cuda-lib, carried back) skips the build.
#   2. at the same time: the project's native CPU kernels (cmake on native/, nanobind from
#      .gpu_bench/wheels) and the two benchmark GGUFs, Q4_0 (benchmarks/make_midsize_qwen3.py: the
#      mid-size Qwen3-shaped model and the DeepSeek-V3-shaped one, 8 layers x 128 experts each).
#   3. while the build runs (the card idle otherwise): scripts/gpu_check.py's sections "stored
#      experts" and "stored projections" (CHECK_BUDGET s, 180): a MoE layer's GPU experts, the
#      always-read projections and MLA's kv_b (its per-head products) at DeepSeek-V3's width held
#      as the GGUF stores them, their decode read rate against the card's copy rate (target >= 70 %),
#      errors, block sizes.
#   4. per model: `python -m hybridmoe.backend.bench.gpu_side_by_side FILE --gpu-share 0.5
#      --gpu-experts stored`: a plan made on this machine with half the routed experts on the GPU in
#      whole layers (the last four MoE layers; llama.cpp: -ngl all, -ot of the first four layers'
#      experts to the CPU), the engine holding its GPU experts as the file stores them (the bytes
#      llama.cpp holds); decode at 64 and 4096 positions, prefill of 512 and 4096 tokens, the
#      backends taking turns pair by pair; host read bandwidth before every pair, the card's pinned
#      host-to-device copy rate at the start and the end.
#   Targets (issue 46): engine / llama.cpp decode >= 1.3x at 64 and 4096 positions, prefill of 4096
#   tokens >= 2x, for both models; GPU experts and projections read at >= 70 % of the copy rate.
#
# Writes under $OUT: side-by-side-{mid,dsv3}.{txt,json} (tables and every pass), gpu-check-stored.{txt,json}
# (the stored-form read rates), summary.txt, the
# workers' logs, the build logs, timeline.txt and llama-cuda-lib/ (the built libraries, stripped,
# for a later run to carry). Python packages the device lacks come from .gpu_bench/wheels (added to
# PYTHONPATH only for what cannot be imported already). Exit status: 0 when both comparisons ran.
set -u
T0=$(date +%s)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
GB=$ROOT/.gpu_bench
OUT=${OUT:-${GPU_BENCH_WORK:-/tmp/hybridmoe-gpu-bench}/out}
WORK=${GPU_BENCH_WORK:-/tmp/hybridmoe-gpu-bench}
JOBS=${JOBS:-16}
PAIRS=${PAIRS:-6}
BUDGET=${BUDGET:-480}        # seconds for the whole script; the comparisons get what the builds leave
CHECK_BUDGET=${CHECK_BUDGET:-180}  # seconds for the stored-form read rates (beside the build; 0: none)
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$WORK"
log() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/timeline.txt"; }

if [ ! -d "$GB/llama.cpp" ] || [ ! -d "$GB/python/llama_cpp" ]; then
  echo "error: $GB is missing or incomplete: run 'python scripts/prepare_gpu_bench.py' on a machine with PyPI" \
       "and carry .gpu_bench (run tool: carry=[\".gpu_bench\"])" >&2
  exit 2
fi
command -v nvcc >/dev/null || { echo "error: no nvcc on PATH: llama.cpp's CUDA backend cannot be built" >&2; exit 2; }

# The repository as the hybridmoe package (what an editable install maps), plus the native extension.
SITE=$WORK/site
mkdir -p "$SITE/hybridmoe"
for d in app backend assets; do ln -sfn "$ROOT/$d" "$SITE/hybridmoe/$d"; done
PP=$SITE:$GB/python
for dir in "$GB"/wheels/*/; do
  mod=$(basename "$dir")
  "$PY" -c "import $mod" 2>/dev/null || PP=$PP:${dir%/}
done
export PYTHONPATH=$PP${PYTHONPATH:+:$PYTHONPATH}
log "python $("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'); nvcc $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'); PYTHONPATH=$PYTHONPATH"

# What ggml-cuda links that a toolkit assembled from NVIDIA's pip wheels (nvcc, runtime: as on
# the machines this project is developed on) may lack: cuBLAS (PyTorch's own copy then, headers
# and library) and libcuda.so for the driver API (the driver's libcuda.so.1 then). Prints the
# CMake arguments; the folders to load cuBLAS from at run time go to $WORK/cuda-lib-dirs.
cuda_arguments() {
  local home=${CUDA_HOME:-${CUDA_PATH:-/usr/local/cuda}} roots lib lt inc drv
  : > "$WORK/cuda-lib-dirs"
  if ! ls "$home"/lib64/libcublas.so* "$home"/lib/libcublas.so* "$home"/targets/*/lib/libcublas.so* >/dev/null 2>&1; then
    roots=$("$PY" -c 'import site; print(" ".join(site.getsitepackages()))')
    lib=$(find $roots -name 'libcublas.so*' 2>/dev/null | sort | head -1)
    lt=$(find $roots -name 'libcublasLt.so*' 2>/dev/null | sort | head -1)
    inc=$(find $roots -name cublas_v2.h 2>/dev/null | head -1)
    if [ -n "$lib" ] && [ -n "$lt" ] && [ -n "$inc" ]; then
      echo "-DCUDA_cublas_LIBRARY=$lib -DCUDA_cublasLt_LIBRARY=$lt -DCMAKE_CUDA_FLAGS=-I$(dirname "$inc")" \
           "-DCMAKE_CXX_FLAGS=-I$(dirname "$inc")"
      dirname "$lib" > "$WORK/cuda-lib-dirs"
    fi
  fi
  if ! ls "$home"/lib64/libcuda.so "$home"/lib64/stubs/libcuda.so "$home"/lib/stubs/libcuda.so >/dev/null 2>&1; then
    drv=$(ldconfig -p 2>/dev/null | sed -n 's/.*libcuda\.so\.1 .*=> \(.*\)/\1/p' | head -1)
    if [ -n "$drv" ]; then echo "-DCUDA_cuda_driver_LIBRARY=$drv"; else echo "-DGGML_CUDA_NO_VMM=ON"; fi
  fi
}

# 1. llama.cpp with CUDA (background).
LIB=$GB/llama-cuda-lib
if [ -f "$LIB/libllama.so" ] && ls "$LIB"/libggml-cuda.so* >/dev/null 2>&1; then
  log "llama.cpp: carried libraries in $LIB, no build"
  cuda_arguments > /dev/null  # only for where cuBLAS is loaded from
  : > "$WORK/llama.done"
else
  LIB=$WORK/llama-build/bin
  CUDA_ARGS=$(cuda_arguments)
  log "llama.cpp: CMake arguments for this toolkit: ${CUDA_ARGS:-none}"
  (
    # shellcheck disable=SC2086 # CUDA_ARGS: separate arguments, no spaces inside any
    cmake -S "$GB/llama.cpp" -B "$WORK/llama-build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON $CUDA_ARGS \
      -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA_ALL_QUANTS=OFF -DGGML_CUDA_FA_QUANTS=f16-f16 \
      -DGGML_CUDA_NCCL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
      -DLLAMA_OPENSSL=OFF \
    && ninja -C "$WORK/llama-build" -j"$JOBS" llama \
    && : > "$WORK/llama.done"
  ) > "$OUT/llama-build.log" 2>&1 &
  LLAMA_PID=$!
  log "llama.cpp: CUDA build started ($(find "$GB/llama.cpp/ggml/src/ggml-cuda" -name '*.cu' | wc -l) .cu files in the tree, -j$JOBS)"
fi

# 2. The native CPU kernels and the GGUFs (background, beside the build).
(
  cmake -S "$ROOT/native" -B "$WORK/native-build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DPython_EXECUTABLE="$(command -v "$PY")" \
  && ninja -C "$WORK/native-build" -j2 \
  && cp "$WORK"/native-build/_native*.so "$SITE/hybridmoe/"
) > "$OUT/native-build.log" 2>&1 &
NATIVE_PID=$!
# Each maker's PyTorch takes 4 threads, so that nvcc keeps most of the cores. A GGUF already in
# $WORK (a machine kept from an earlier run) is used as it is.
make_gguf() {  # name, extra arguments
  if [ -f "$WORK/$1-q4_0.gguf" ]; then echo "gguf: $WORK/$1-q4_0.gguf (already there)"; return 0; fi
  OMP_NUM_THREADS=4 "$PY" "$ROOT/benchmarks/make_midsize_qwen3.py" "$WORK/$1" --quant q4_0 "${@:2}" && rm -rf "${WORK:?}/$1"
}
make_gguf mid > "$OUT/make-mid.log" 2>&1 &
MID_PID=$!
make_gguf dsv3 --family deepseek_v3 > "$OUT/make-dsv3.log" 2>&1 &
DSV3_PID=$!

# 3. The stored-form read rates on the card, which the build leaves idle (its CPU work is Triton's
# compiles, a few of them).
if [ "$CHECK_BUDGET" -gt 0 ]; then
  timeout "$(( CHECK_BUDGET + 30 ))" "$PY" "$ROOT/scripts/gpu_check.py" --sections "stored experts,stored projections" \
    --budget "$CHECK_BUDGET" --json "$OUT/gpu-check-stored.json" > "$OUT/gpu-check-stored.txt" 2>&1 &
  CHECK_PID=$!
  log "stored-form read rates started (${CHECK_BUDGET} s at most)"
fi

wait $NATIVE_PID && log "native extension built" || log "native extension FAILED (see native-build.log); CPU experts take the PyTorch path"
wait $MID_PID && log "mid-size GGUF made: $(tail -1 "$OUT/make-mid.log")" || log "mid-size GGUF FAILED (make-mid.log)"
wait $DSV3_PID && log "DeepSeek-V3-shaped GGUF made: $(tail -1 "$OUT/make-dsv3.log")" || log "DeepSeek-V3-shaped GGUF FAILED (make-dsv3.log)"
if [ -n "${LLAMA_PID:-}" ]; then
  wait $LLAMA_PID
  if [ -f "$WORK/llama.done" ]; then
    log "llama.cpp built: $(ls "$LIB"/*.so | xargs -n1 basename | tr '\n' ' ')"
    # For a later run to carry (.gpu_bench/llama-cuda-lib): $OUT brings back no symbolic links, so
    # each library under its SONAME (what the others ask the loader for), and libllama, libggml,
    # libggml-base also under the plain names llama-cpp-python and backend/llamacpp/library.py open.
    mkdir -p "$OUT/llama-cuda-lib"
    for f in "$LIB"/lib*.so*; do
      [ -L "$f" ] && continue
      so=$(readelf -d "$f" | sed -n 's/.*SONAME.*\[\(.*\)\]/\1/p')
      cp "$f" "$OUT/llama-cuda-lib/${so:-$(basename "$f")}"
    done
    strip --strip-unneeded "$OUT"/llama-cuda-lib/lib* 2>/dev/null
    for name in llama ggml ggml-base; do
      [ -f "$OUT/llama-cuda-lib/lib$name.so.0" ] && cp "$OUT/llama-cuda-lib/lib$name.so.0" "$OUT/llama-cuda-lib/lib$name.so"
    done
    log "llama.cpp libraries for a later run: $(du -sh "$OUT/llama-cuda-lib" | cut -f1)"
  else
    log "llama.cpp build FAILED: $(tail -3 "$OUT/llama-build.log" | tr '\n' ' ')"
  fi
fi
if [ -n "${CHECK_PID:-}" ]; then
  wait $CHECK_PID && log "stored-form read rates done" || log "stored-form read rates: a section failed or timed out (gpu-check-stored.txt)"
  grep -E "^(Q4_K_M|IQ|Q4_0|o_proj|q_a_proj|q_b_proj|kv_a_proj|shared down|lm_head|target|device copy)" "$OUT/gpu-check-stored.txt" | tee -a "$OUT/summary.txt"
fi
[ -f "$WORK/llama.done" ] || exit 1
export LLAMA_CPP_LIB_PATH=$LIB
# The libraries' own dependencies (libggml*.so beside libllama.so) from the same folder, and
# PyTorch's cuBLAS where the toolkit had none.
CUDA_DIRS=$(cat "$WORK/cuda-lib-dirs" 2>/dev/null)
export LD_LIBRARY_PATH=$LIB${CUDA_DIRS:+:$CUDA_DIRS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

# 4. The comparisons, each within the time left.
status=0
for model in mid dsv3; do
  file=$WORK/$model-q4_0.gguf
  left=$(( BUDGET - ($(date +%s) - T0) - 25 ))
  if [ ! -f "$file" ] || [ "$left" -lt 30 ]; then
    log "$model: skipped (file missing or ${left} s left)"; status=1; continue
  fi
  # The first model may take half of what is left, the second the rest.
  [ "$model" = mid ] && limit=$(( left / 2 )) || limit=$left
  log "$model: side by side (${limit} s at most)"
  # --budget ends the run with a table; timeout is the backstop (the JSON is written after every pair).
  timeout "$(( limit + 20 ))" "$PY" -m hybridmoe.backend.bench.gpu_side_by_side "$file" --gpu-share 0.5 \
    --gpu-experts stored --pairs "$PAIRS" --decode-tokens 32 --budget "$(( limit - 15 ))" --out "$OUT/side-by-side-$model.json" --logs "$OUT/logs-$model" ${BENCH_ARGS:-} \
    > "$OUT/side-by-side-$model.txt" 2> "$OUT/side-by-side-$model.progress" || status=1
  cat "$OUT/side-by-side-$model.txt" | tee -a "$OUT/summary.txt"
  log "$model: done"
done
log "finished (status $status)"
exit $status
