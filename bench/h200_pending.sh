#!/usr/bin/env bash
# The pending H200 calls of docs/benchmarks.md ("GPU runs still pending"), run only on an H200.
# A call for the nvidia-h200 kind may be served by an H100, whose figures for these rows are
# measured already: there it runs nothing and exits 3 (give the machine back at once).
# Usage (on the GPU; carry [".whl", ".benchassets", ".basetree"], made here, after the last
# change to the tree, by `.venv/bin/python bench/device_assets.py --basetree <previous main>`):
#   BUDGET=570 bash bench/h200_pending.sh first  # the persistent path against the layer loop
#       at ~128 and ~1k tokens, engine_check; HTTP c=1 (1k-token TTFT, TPOT) in .basetree then
#       here; the offline benchmark (nano-vllm's workload)
#   BUDGET=300 bash bench/h200_pending.sh short  # the persistent path at ~1k (on, then the layer
#       loop) and ~128 tokens, engine_check: for a session with under ~700 s of device time
# (BUDGET: seconds for bench/pending_ab.sh's stages, its BUDGET_S)
set -u
case "${1:-first}" in
  first|short) ;;
  *) echo "usage: BUDGET=SECONDS bash bench/h200_pending.sh first|short" >&2; exit 2 ;;
esac
name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
echo "GPU: ${name:-none found by nvidia-smi}"
# the code carried: the stamps bench/device_assets.py wrote, and whether the files still match
cat .benchassets/trees.txt 2>/dev/null || echo "(no .benchassets/trees.txt: trees unrecorded)"
if sha256sum -c --quiet .benchassets/tree.sha256 >/dev/null 2>&1; then
  echo "files: as when the stamps were written"
else
  echo "WARNING: the files differ from .benchassets/tree.sha256 (or it is missing): the stamps" \
       "above do not name this tree"
fi
case "$name" in *H200*) ;; *) echo "not an H200: nothing run"; exit 3 ;; esac
case "${1:-first}" in
  first) BUDGET_S=${BUDGET:-${BUDGET_S:-570}} PERSIST_TESTS=0 PERSIST_PROBE="" SERVE_CONC=1 \
           SERVE_PROMPT=1024 PERSIST_ENGINE="128 0;128 -;1024 0;1024 -" \
           bash bench/pending_ab.sh persistab serveab offline ;;
  short) BUDGET_S=${BUDGET:-${BUDGET_S:-300}} PERSIST_TESTS=0 PERSIST_PROBE="" \
           PERSIST_ENGINE="1024 -;1024 0;128 -" bash bench/pending_ab.sh persistab ;;
esac
