#!/usr/bin/env bash
# One device call: engine correctness on the GPU, offline throughput, online serving.
# Usage: bash bench/run_gpu.sh [stages...]   (stages: kernels prefill_long check offline profile serve peer both moe fp8 fp8sweep structured; default: check offline serve)
# Env: SERVE_CONC (serve levels, default 1 16 64), PREFILL_ARGS (prefill_long flags, default --sweep), HF_SECONDS (0 = skip transformers offline), QWEN_SERVE_* (server flags).
# Expects carried wheels in .whl (fastapi, uvicorn, pydantic, ...) and .benchassets/tokenizer.
set -u
source "$(dirname "$0")/gpu_env.sh"
stages=${*:-check offline serve}
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
for s in $stages; do
  case $s in
    kernels) timeout 150 python3 bench/kernels.py --only prefill --out "$OUT/kernels" 2>&1 | grep -v Warning | tail -14 ;;
    prefill_long) timeout 300 python3 bench/prefill_long.py ${PREFILL_ARGS:---sweep} --out "$OUT/prefill_long" 2>&1 | grep -v Warning | tee "$OUT/prefill_long.log" ;;
    check) timeout 240 python3 bench/engine_check.py --ckpt $CKPT 2>&1 | tee "$OUT/check.log" ;;
    offline) hf="--hf-seconds ${HF_SECONDS:-90}"; [ "${HF_SECONDS:-90}" = 0 ] && hf=--skip-hf
             timeout 300 python3 bench/offline.py --ckpt $CKPT $hf --serve-shape 2>&1 | grep -v Warning | tee "$OUT/offline.log" ;;
    profile) timeout 300 python3 bench/profile_offline.py --ckpt $CKPT 2>&1 | grep -v Warning | tee "$OUT/profile.log" ;;
    serve) timeout 400 python3 bench/serve.py --ckpt $CKPT --tokenizer-from .benchassets/tokenizer --skip-peer --out "$OUT" \
             --concurrency ${SERVE_CONC:-1 16 64} --py-spy-level ${SPY_LEVEL:-64} 2>&1 | tee "$OUT/serve.log"
           [ -f "$OUT/pyspy_c${SPY_LEVEL:-64}.txt" ] && python3 bench/pyspy_top.py "$OUT/pyspy_c${SPY_LEVEL:-64}.txt" > "$OUT/pyspy_top.txt" ;;
    both) timeout 560 python3 bench/serve.py --ckpt $CKPT --tokenizer-from .benchassets/tokenizer --peer-concurrency ${PEER_CONC:-1 16 64} --peer-time-cap 40 --out "$OUT" 2>&1 | tee "$OUT/both.log" ;;
    moe) timeout 540 python3 bench/moe.py --out "$OUT" ${MOE_ARGS:-} 2>&1 | grep -v Warning | tee "$OUT/moe.log" ;;
    fp8) timeout 540 python3 bench/fp8.py --out "$OUT" ${FP8_ARGS:-} 2>&1 | grep -v Warning | tee "$OUT/fp8.log" ;;
    fp8sweep) timeout 300 python3 bench/fp8_sweep.py --out "$OUT" --write-table 2>&1 | grep -v Warning | tee "$OUT/fp8_sweep.log" ;;
    structured) timeout 240 python3 bench/structured.py --ckpt $CKPT --tokenizer-from .benchassets/tokenizer --out "$OUT" 2>&1 | tee "$OUT/structured.log" ;;
    peer) timeout 500 python3 bench/serve.py --ckpt $CKPT --tokenizer-from .benchassets/tokenizer --concurrency ${PEER_CONC:-1 16 64} --peer-time-cap 60 --out "$OUT" --skip-ours 2>&1 | tee "$OUT/peer.log" ;;
  esac
done
