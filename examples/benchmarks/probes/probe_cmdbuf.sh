#!/usr/bin/env bash
# Do XLA's CUDA graphs (command buffers) take jaxdata's hector calls, and what does that do to a
# small graph's inference? Runs after `bash .ci/gpu build`, on the GPU machine.
#
# XLA_FLAGS variants, side by side in one run:
#   split:   --xla_gpu_enable_command_buffer without CUSTOM_CALL (every FFI call splits XLA's
#            graphs, as before jaxdata_hector_launch was command-buffer compatible)
#   default: XLA's defaults (CUSTOM_CALL included, a graph needs 5 commands)
#   min1:    the defaults with --xla_gpu_graph_min_graph_size=1
# Usage: bash probe_cmdbuf.sh [dispatch] [rgcn] [rgat]   (default: all three)
set -uo pipefail
OUT=${OUT:-/tmp/jaxdata-gpu-out}
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export JAXDATA_CACHE_DIR=${JAXDATA_CACHE_DIR:-/tmp/jaxdata-cache} XLA_PYTHON_CLIENT_PREALLOCATE=false
[ -d .data ] && export JAXDATA_DATA_DIR=$PWD/.data
declare -A FLAGS=(
  [split]="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUDNN"
  [default]=""
  [min1]="--xla_gpu_graph_min_graph_size=1"
)
rows() { grep -E '^\| (aifb|mutag) \| 32 \| (jaxdata|PyG|per-edge|transform)' "$1" | cut -d'|' -f2-6,11; }
# the first run of a tensor-core instance tunes its tilings (outside the graphs); later
# processes read the recorded choice, so every variant below runs the same kernels
python3 probe_dispatch.py aifb 32 >/dev/null 2>&1
python3 probe_dispatch.py mutag 32 >/dev/null 2>&1
for stage in ${*:-dispatch rgcn rgat}; do
  for v in split default min1; do
    echo "=== $stage, XLA_FLAGS=${FLAGS[$v]:-(none)} ($v)"
    case $stage in
      dispatch)
        for g in aifb mutag; do
          XLA_FLAGS="${FLAGS[$v]}" timeout 120 python3 probe_dispatch.py $g 32 2>&1 | grep -v Warning
        done ;;
      rgcn)
        XLA_FLAGS="${FLAGS[$v]}" timeout 200 jaxdata bench rgnn --mode inference --model rgcn \
          --graphs aifb,mutag --dims 32 --precision both --write "$OUT/inference-rgcn-$v.md" \
          >"$OUT/inference-rgcn-$v.log" 2>&1 || tail -5 "$OUT/inference-rgcn-$v.log"
        rows "$OUT/inference-rgcn-$v.md" ;;
      rgat)
        XLA_FLAGS="${FLAGS[$v]}" timeout 200 jaxdata bench rgnn --mode inference --model rgat \
          --graphs aifb,mutag --dims 32 --precision both \
          --formulations "jaxdata,transform-all-then-gather,per-edge weights,PyG" \
          --write "$OUT/inference-rgat-$v.md" >"$OUT/inference-rgat-$v.log" 2>&1 \
          || tail -5 "$OUT/inference-rgat-$v.log"
        rows "$OUT/inference-rgat-$v.md" ;;
    esac
  done
done
