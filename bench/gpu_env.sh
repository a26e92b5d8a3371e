# Sourced by the device-call scripts (run_gpu.sh, latency_ab.sh): $OUT, the carried wheels in
# .whl installed into /tmp/site (the image lacks fastapi, uvicorn, pydantic, llguidance, ...),
# unbuffered Python, the random Qwen3-0.6B checkpoint path, and the GPU's name in $OUT/gpu.txt.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
export PYTHONUNBUFFERED=1
CKPT=/tmp/qwen3-0.6b-random
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
