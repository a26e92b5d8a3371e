#!/usr/bin/env bash
# One device call for the latency issue: kernel sweep and checks, then the previous main against
# this tree. Usage (on the GPU): OLD=.basetree bash bench/latency_ab.sh
#   1. bench/gemv.py --sweep --write-table: the small-M GEMV tiles vs cuBLAS (writes the table
#      this tree's engine then reads; the JSON comes back in $OUT)
#   2. the kernel tests on the GPU (real Triton): gemv, decode attention, the fused kernels
#   3. bench/engine_check.py: engine correctness against torch attention run eagerly
#   4. bench/decode_profile.py for OLD, this tree, and this tree with each new kernel switched
#      off: kernels per decode step, top kernels, host profile
#   5. bench/ab_trees.py: offline, batch-1 TTFT/TPOT (engine only), serving at c=1/64/256
# Expects carried wheels in .whl, .benchassets/tokenizer and the old tree at $OLD.
set -u
OLD=${OLD:-.basetree}
source "$(dirname "$0")/gpu_env.sh"
T0=$SECONDS
stamp() { echo "== $1 at $((SECONDS - T0)) s"; }
timeout 150 python3 bench/gemv.py --sweep --write-table --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/gemv.txt" | grep -v '^{'
stamp gemv
TRITON_INTERPRET=0 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemv.py \
  tests/kernels/test_decode_attention.py tests/kernels/test_qk_norm_rope.py tests/kernels/test_triton_backend.py \
  2>&1 | tail -6 | tee "$OUT/gpu_tests.txt"
stamp tests
timeout 120 python3 bench/engine_check.py --ckpt $CKPT 2>&1 | grep -v Warning | tee "$OUT/check.txt" | tail -12
stamp check
profile() {  # label, env, decode_profile args
  env $2 timeout 80 python3 bench/decode_profile.py --ckpt $CKPT --label "$1" "${@:3}" 2>&1 \
    | grep -v "Warning\|warn" | tee -a "$OUT/decode_profile.txt" | grep -v '^{'
}
profile old "X=1" --tree "$OLD" --batch 1
profile new "X=1" --tree . --batch 1 64 --host-profile
profile new-gemv-off "QWEN_SERVE_SMALL_M_GEMV=0" --tree . --batch 1
profile new-qk-rope-off "QWEN_SERVE_FUSED_QK_ROPE=0" --tree . --batch 1
stamp profile
left=$(( ${BUDGET_S:-575} - (SECONDS - T0) ))  # what the device call has left
timeout $(( left < 300 ? left : 300 )) python3 bench/ab_trees.py --old "$OLD" --repeats 2 --serve-conc 1 64 256 --out /tmp/ab 2>&1 \
  | grep -v "Writing\|Warning" > "$OUT/ab_trees.txt"; tail -16 "$OUT/ab_trees.txt"
stamp ab
