#!/usr/bin/env bash
# The session's last device call (issues 18 and 19), in priority order within BUDGET_S seconds:
#   1. bench/gemv.py --fused --write-table: the norm / SwiGLU-fused GEMVs against the unfused
#      pairs; writes kernels/configs/gemv_fused_<device>.json, which the engines below read
#   2. GPU tests: the host-step changes' CUDA paths (graph inputs staged in place, pinned
#      staging, cached sampling metadata), the fused GEMVs, the FP8 cuBLASLt probe under a bf16
#      default dtype
#   3. bench/engine_check.py: this tree's engine (fusions as the table says) against torch eager
#   4. bench/fp8.py --stages engine: Qwen3-8B shape, bf16 and FP8 (cuBLASLt buckets, probed)
#   5. bench/decode_profile.py --batch 1: this tree, the previous main ($OLD), this tree with the
#      fusions off
# Usage (on the GPU): OLD=.basetree bash bench/final_call.sh
set -u
OLD=${OLD:-.basetree}
source "$(dirname "$0")/gpu_env.sh"
T0=$SECONDS
stamp() { echo "== $1 at $((SECONDS - T0)) s"; }
left() { local l=$(( ${BUDGET_S:-560} - (SECONDS - T0) )); echo $(( l < $1 ? l : $1 )); }
timeout "$(left 110)" python3 bench/gemv.py --fused --write-table --out "$OUT" 2>&1 \
  | grep -v Warning > "$OUT/gemv_fused.txt"; grep -v '^{' "$OUT/gemv_fused.txt" | tail -14
cp kernels/configs/gemv_fused_*.json "$OUT/" 2>/dev/null
stamp sweep
TRITON_INTERPRET=0 timeout "$(left 120)" python3 -m pytest -q -p no:cacheprovider \
  tests/unit/test_prefill_graphs.py tests/unit/test_staging.py tests/unit/test_sampling_metadata.py \
  tests/unit/test_step_inputs.py tests/kernels/test_gemv_fused.py "tests/kernels/test_fp8_gemm.py::test_cublas_probe_records_the_answer_per_device" \
  tests/kernels/test_fp8_gemm.py::test_cublas_path_matches_the_reference 2>&1 \
  | tail -8 | tee "$OUT/gpu_tests.txt"
stamp tests
timeout "$(left 110)" python3 bench/engine_check.py --ckpt $CKPT 2>&1 | grep -v Warning \
  | tee "$OUT/check.txt" | tail -9
stamp check
timeout "$(left 130)" python3 bench/fp8.py --out "$OUT/fp8" --stages engine 2>&1 \
  | grep -v "Warning\|Writing" > "$OUT/fp8_engine.log"; grep "^|\|cuBLASLt\|Error" "$OUT/fp8_engine.log" | tail -8
stamp fp8
profile() {  # label, tree, env
  env $3 timeout "$(left 80)" python3 bench/decode_profile.py --ckpt $CKPT --tree "$2" \
    --label "$1" --batch 1 2>&1 | grep -v "Warning\|warn" | tee -a "$OUT/decode_profile.txt" \
    | grep -v '^{' | head -16
}
profile new . "X=1"
profile old "$OLD" "X=1"
profile new-unfused . "QWEN_SERVE_FUSED_NORM_GEMV=0 QWEN_SERVE_FUSED_SWIGLU_GEMV=0"
stamp profile
