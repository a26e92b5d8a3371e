#!/usr/bin/env bash
# One device call for issue 19's decode fusions (kernels/gemv_fused.py). Usage (on the GPU, from
# the repository root): bash bench/decode_fusions.sh   (about 5 minutes)
#   1. bench/gemv.py --fused --write-table: the fused GEMVs against the unfused pairs; writes
#      kernels/configs/gemv_fused_<device>.json, which the engine below then reads (the JSON also
#      comes back in $OUT: commit it if the run is good); without it nothing is fused
#   2. the kernel tests on the GPU (real Triton): gemv and the fused GEMVs
#   3. bench/decode_profile.py at batch 1 with the fusions on and off (the switches of
#      engine/layers/kernel_switches.py): kernels per decode step, top kernels, TPOT
#   4. bench/engine_check.py: engine correctness against torch attention run eagerly
# Expects carried wheels in .whl (bench/gpu_env.sh installs them).
set -u
source "$(dirname "$0")/gpu_env.sh"
T0=$SECONDS
stamp() { echo "== $1 at $((SECONDS - T0)) s"; }
timeout 120 python3 bench/gemv.py --fused --write-table --out "$OUT" 2>&1 | grep -v Warning \
  | tee "$OUT/gemv_fused.txt" | grep -v '^{'
stamp sweep
TRITON_INTERPRET=0 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemv.py \
  tests/kernels/test_gemv_fused.py 2>&1 | tail -6 | tee "$OUT/gpu_tests.txt"
stamp tests
profile() {  # label, env, decode_profile args
  env $2 timeout 90 python3 bench/decode_profile.py --ckpt $CKPT --label "$1" "${@:3}" 2>&1 \
    | grep -v "Warning\|warn" | tee -a "$OUT/decode_profile.txt" | grep -v '^{'
}
profile fused "X=1" --tree . --batch 1
profile unfused "QWEN_SERVE_FUSED_NORM_GEMV=0 QWEN_SERVE_FUSED_SWIGLU_GEMV=0" --tree . --batch 1
stamp profile
left=$(( ${BUDGET_S:-575} - (SECONDS - T0) ))
timeout $(( left < 120 ? left : 120 )) python3 bench/engine_check.py --ckpt $CKPT 2>&1 \
  | grep -v Warning | tee "$OUT/check.txt" | tail -12
stamp check
