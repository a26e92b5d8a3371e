#!/usr/bin/env bash
# The runs docs/benchmarks.md lists as pending (issues 18, 19, 20), against the previous main.
# Usage (on the GPU): OLD=.basetree bash bench/pending_ab.sh [stages...]
#   (default "tests dense", ~6 minutes; "decode", "ab" and "lc" fill a call each; a stage is
#   skipped, saying so, when under 20 s of BUDGET_S (575) are left)
#   tests:  the GPU kernel tests (real Triton, up to 240 s: they compile for ~2 minutes; the
#           cuBLASLt FP8 path's correctness test on sm_90, the strided-cache KV_TMA refusal,
#           the cuDNN lone-prompt path)
#   check:  bench/engine_check.py, engine correctness against torch attention run eagerly
#   dense:  bench/dense_prefill.py --engine (cuDNN on and off for one long prompt) and the
#           start-up line of the server (the whole-prompt range measured after the graphs)
#   decode: bench/kernels.py --only decode with the engine's 128-token pages (tiles and split
#           counts swept: decode_config was chosen on 16-token pages), with the fused
#           split merge, then with 16-token pages
#   decprof: bench/decode_profile.py at batch 1 and 64 with the fused merge and the q/k norm +
#           rotary decode prologue off/on (DECPROF="00 11" picks the combinations, merge first)
#   fusedcheck: engine_check with both fusions on
#   fp8:    bench/fp8_sweep.py --write-table, the FP8 tiles with the cuBLASLt block-scaled kind
#           timed too (the table comes back in $OUT; commit it if the run is good)
#   ab:     bench/ab_trees.py, offline, batch-1 TTFT/TPOT (engine only), serving at c=64/256
#   lc:     bench/long_context.py, $OLD and this tree, 1k / 8k / 32k prompts at c=1 and 8
#   fp8ab:  bench/fp8.py --stages kernels engine in $OLD, then here (after "fp8" wrote the table)
#   ttft:   bench/prefill_profile.py --prompt 1024: the 1k-token prompt's first-token step by
#           kernel family (GEMMs, attention, norms, the empty decode-row launch), the profile
#           issue 19's 6 ms TTFT needs next
#   swiglu: the Triton SwiGLU (kernels/swiglu.py): its GPU test, bench/swiglu.py against the
#           compiled composition, engine_check and the 1k prefill profile with it on and off
#   serveab: bench/serve.py at c=1/64/256 (greedy, 1,024-token prompts), $OLD then this tree,
#           the server flags from $SERVE_ARGS (e.g. "--api-server-count 2"), the concurrencies
#           from $SERVE_CONC, the prompts' tokens from $SERVE_PROMPT (1024), requests per unit
#           of concurrency from $SERVE_RPC (2; 8: the start and end ramps weigh less)
#   ttftab: bench/prefill_profile.py --prompt 1024 in this tree then in $OLD (and each run's
#           seconds, start-up and graph capture included); TTFT_ROUNDS alternations (1),
#           TTFT_REPEATS unprofiled first tokens per run (3); this tree's script runs in both
#   httpab: bench/serve.py at c=1/64/256 with --http h11, then httptools (this tree)
#   attn:   bench/kernels.py --only prefill, then --only decode: the Triton attention kernels
#           against torch SDPA in the same call (the engine's 128-token pages)
#   sampling: bench/serve.py --sampling qwen3 (top_k 20, top_p 0.95) at c=1/64, $OLD and here
#   peer:   bench/serve.py at c=1/64/256 with --api-server-count 2, the transformers peer at 1/64
#   front:  bench/frontend_latency.py: a 1,024-token request's time outside the engine by stage,
#           $OLD and this tree, then --engine-idle-poll-ms 1000, then 5 ms between requests
#           (FRONT="new gap" picks variants)
#   mergeab: the split merge in the o projection (kernels/gemv_merge.py): its GPU tests,
#           bench/gemv.py --fused on "0.6B o+merge" (this GPU's table written), then
#           bench/decode_profile.py at batch 1 and 64 in $OLD, here with the fusion off
#           (QWEN_SERVE_FUSED_MERGE_GEMV=0), here with it on (its table entry set to fused
#           for the run, whatever the sweep said), alternating MERGE_ROUNDS (1) times, and
#           engine_check with it on
#   splits: bench/decode_profile.py at batch 1 and 4 in $OLD, then here with the pure decode
#           launches' split count capped (QWEN_SERVE_DECODE_MAX_SPLITS in $SPLITS, "64 16 4 1";
#           1: no merge launch)
#   qkvrope: the fused q/k/v + q/k norm + rotary + KV store kernel's GPU tests, then its sweep
#           against today's pair (norm GEMV, then the q/k norm + rotary + store launch) for
#           Qwen3-0.6B (bench/gemv.py --fused; the table comes back in $OUT, not committed here)
#   qkvab:  (QKV_SWEEP=0: without) that sweep with --write-table (this GPU's fused table, in the device's tree and
#           $OUT; the tree's copy then forced to fuse), then bench/decode_profile.py at batch
#           ${QKV_BATCHES:-1 2 4 16} in $OLD (120 s: its kernels compile afresh), here with the
#           fusion off, and on (QWEN_SERVE_FUSED_QKV_ROPE_GEMV 0/1, ${QKV_ROUNDS:-2} rounds),
#           and engine_check with it on
#   gridbar: bench/grid_barrier_probe.py (a grid barrier in one persistent kernel against a kernel
#           boundary with PDL, on the 112-GEMV chain of pdl_probe) with the arguments in $GRIDBAR
#           (argument lists separated by ';'), after its GPU test
#   layer:  bench/persistent_layer_probe.py (28 Qwen3-0.6B decoder layers of one decode token in
#           one persistent launch, $LAYER_ARGS) after its GPU test, then this tree's batch-1
#           decode step (bench/decode_profile.py) for comparison
#   persist: the persistent kernels' GPU tests (and the model's path against its layer loop),
#           then bench/decode_profile.py at batch 1 with
#           QWEN_SERVE_PERSISTENT_DECODE 0 and 1 (${PERSIST_ROUNDS:-2} alternations), and
#           engine_check with it on
#   persistab: the persistent kernels' GPU tests, the engine's batch-1 step for each of
#           $PERSIST_ENGINE's variants
#           ("[TREE] PROMPT SWITCH [QWEN_SERVE_PERSISTENT_...=V ...]", ';'-separated; SWITCH
#           0/1 sets QWEN_SERVE_PERSISTENT_DECODE, "-" leaves it unset; default: the
#           layer loop at 128-, 1,024- and 2,000-token prompts, the default path at those and
#           448 -- its per-head layout up to 512 tokens of context, per-row up to 2,048),
#           engine_check with it on (plus $PERSIST_CHECK's variables), then the layer probe's
#           runs in $PERSIST_PROBE (';'-separated argument lists; default the layouts 1000 1010
#           10001 10101 with the first K/V tile, pre_kv, and the first weight chunks, pre_w,
#           loaded during the waits; "": none); PERSIST_TESTS=0: no tests
#   wideab: the plain GEMV at 17-64 rows (kernels/gemv.py's "m64" table row): its GPU tests,
#           bench/decode_profile.py at batch 32 and 64 (1,024-token prompts) and bench/serve.py
#           at c=64 with cuBLAS (no m64 row yet), then the sweep at M = 64 on Qwen3-0.6B's
#           shapes written to this GPU's table (and $OUT), then the same two runs reading it
#           (WIDE_SERVE=0: no serving runs)
#   offline: bench/offline.py --skip-hf (nano-vllm's workload with its token budget, 16,384:
#           the issue's offline figure), this tree only
#   l2pf:   the L2 prefetch kernel's GPU tests and the PDL ones, bench/l2_prefetch_probe.py (a
#           28-layer GEMV chain with weights cold, hot in L2, and prefetched on a side stream)
# Expects carried wheels in .whl, .benchassets/tokenizer and the old tree at $OLD, all three made
# here by `.venv/bin/python bench/device_assets.py --basetree <previous main>` (carry [".whl",
# ".benchassets", ".basetree"]).
set -u
OLD=${OLD:-.basetree}
source "$(dirname "$0")/gpu_env.sh"
T0=$SECONDS
stamp() { echo "== $1 at $((SECONDS - T0)) s"; }
# seconds for the next command: at most $1 and what the budget has left (at least 1: `timeout 0`
# would mean no limit)
left() { local l=$(( ${BUDGET_S:-575} - (SECONDS - T0) )); l=$(( l < $1 ? l : $1 )); echo $(( l < 1 ? 1 : l )); }
# force_fused ENTRY: set fused_faster on every row of ENTRY in the fused-GEMV table this GPU
# reads (its own, or its architecture's), after saving the file; restore_fused puts it back
# (each stage that forces restores at its end, so later stages run the committed table)
force_fused() {
  FUSED_TABLE=$(python3 -c "import torch; from kernels.configs import device_name, table_device, \
    table_path; n = device_name(torch.device('cuda')); \
    print(table_path('gemv_fused', table_device('gemv_fused', n)))")
  cp "$FUSED_TABLE" "$OUT/fused_table_saved.json" || return 1
  python3 -c "import json, pathlib, sys; p = pathlib.Path(sys.argv[1]); t = json.loads(p.read_text()); \
    e = t[sys.argv[2]]; print(sys.argv[2], 'entry as swept:', e); \
    [r.update(fused_faster=True) for r in e.values()]; p.write_text(json.dumps(t, indent=1))" \
    "$FUSED_TABLE" "$1"
}
restore_fused() { [ -n "${FUSED_TABLE:-}" ] && cp "$OUT/fused_table_saved.json" "$FUSED_TABLE"; FUSED_TABLE=; }
for stage in ${@:-tests dense}; do
  if (( ${BUDGET_S:-575} - (SECONDS - T0) < 20 )); then
    echo "== $stage skipped: under 20 s of the ${BUDGET_S:-575} s budget left"; continue
  fi
  case $stage in
    tests) TRITON_INTERPRET=0 timeout "$(left 240)" python3 -m pytest -q -p no:cacheprovider \
             tests/kernels/test_fp8_gemm.py tests/kernels/test_fp8_configs.py \
             tests/kernels/test_prefill_split.py tests/kernels/test_prefill_kv_tma.py \
             tests/kernels/test_triton_backend.py tests/kernels/test_decode_attention.py \
             tests/unit/test_dense_prefill.py 2>&1 \
             | tail -6 | tee "$OUT/gpu_tests.txt" ;;
    dense) timeout "$(left 150)" python3 bench/dense_prefill.py --engine $CKPT 2>&1 | grep -v Warning \
             > "$OUT/dense.txt"; tail -12 "$OUT/dense.txt"
           (timeout "$(left 120)" python3 -m server --model $CKPT --port 8011 --log-level info \
             > "$OUT/startup.log" 2>&1 &)
           for _ in $(seq 110); do grep -q "whole prompts\|no whole-prompt" "$OUT/startup.log" && break; sleep 1; done
           grep -i "whole.prompt\|cudnn\|ready" "$OUT/startup.log" | tail -4
           pkill -f "server --model $CKPT --port 8011"; sleep 3 ;;
    decode) timeout "$(left 150)" python3 bench/kernels.py --only decode --block-size 128 --sweep \
             --out "$OUT/decode_128" 2>&1 | grep -v Warning | grep "^| \|correctness\|configs" | tail -7
           echo "-- the fused split merge (QWEN_SERVE_DECODE_FUSED_REDUCE=1), 128-token pages"
           QWEN_SERVE_DECODE_FUSED_REDUCE=1 timeout "$(left 120)" python3 bench/kernels.py \
             --only decode --out "$OUT/decode_fused" 2>&1 | grep -v Warning | grep "^| \|correctness" | tail -6
           echo "-- 16-token pages"  # (the tiles of decode_config were chosen on these)
           timeout "$(left 120)" python3 bench/kernels.py --only decode --block-size 16 \
             --out "$OUT/decode_16" 2>&1 | grep -v Warning | grep "^| \|correctness" | tail -6 ;;
    decprof) for v in ${DECPROF:-00 10 01 11}; do  # (fused merge, q/k norm + rotary in the decode prologue)
             QWEN_SERVE_DECODE_FUSED_REDUCE=${v:0:1} QWEN_SERVE_DECODE_FUSED_QK_ROPE=${v:1:1} \
               timeout "$(left 70)" python3 bench/decode_profile.py --tree . --ckpt $CKPT \
               --batch 1 64 --top 6 --label "merge=${v:0:1} qk_rope=${v:1:1}" 2>&1 \
               | grep -v Warning | grep -E '^\||"tpot_ms"' | cut -c1-400 | head -20
           done ;;
    fusedcheck) QWEN_SERVE_DECODE_FUSED_REDUCE=1 QWEN_SERVE_DECODE_FUSED_QK_ROPE=1 timeout "$(left 110)" \
             python3 bench/engine_check.py --ckpt $CKPT 2>&1 | grep -v Warning | tail -6 ;;
    check) timeout "$(left 110)" python3 bench/engine_check.py --ckpt $CKPT 2>&1 | grep -v Warning \
             | tee "$OUT/check.txt" | tail -8 ;;
    fp8)   timeout "$(left 200)" python3 bench/fp8_sweep.py --out "$OUT" --write-table --budget-s 140 \
             --compile-budget-s 60 2>&1 | grep -v Warning > "$OUT/fp8_sweep.log"
           cp kernels/configs/fp8_gemm_*.json "$OUT/" 2>/dev/null
           grep "cublas\|M=4096\|summed\|wall time\| 16 | \| 1 | " "$OUT/fp8_sweep.log" | tail -24 ;;
    ab)    timeout "$(left 260)" python3 bench/ab_trees.py --old "$OLD" --repeats 2 --serve-conc 64 256 \
             --out /tmp/ab 2>&1 | grep -v "Writing\|Warning" > "$OUT/ab_trees.txt"
           tail -16 "$OUT/ab_trees.txt" ;;
    lc)    timeout "$(left 560)" python3 bench/long_context.py --tokenizer-from .benchassets/tokenizer \
             --trees "$OLD" . --skip-hf --out "$OUT/lc" --variants "default=--log-level info" 2>&1 \
             | grep -v "Warn\|Writing" > "$OUT/lc.log"; grep "^|" "$OUT/lc.log" | tail -16 ;;
    fp8ab) for tree in "$OLD" .; do
             name=$([ "$tree" = . ] && echo new || echo old)
             (cd "$tree" && timeout "$(left 150)" python3 bench/fp8.py --out "$OUT/fp8_$name" \
               --stages kernels engine --tokenizer-from "$OLDPWD/.benchassets/tokenizer" 2>&1 \
               | grep -v "Warning\|Writing" > "$OUT/fp8_$name.log")
             echo "-- fp8.py in $name ($tree)"; grep "^|\|summed" "$OUT/fp8_$name.log" | tail -32
           done ;;
    swiglu) TRITON_INTERPRET=0 timeout "$(left 60)" python3 -m pytest -q -p no:cacheprovider \
             tests/kernels/test_swiglu.py 2>&1 | tail -3
           timeout "$(left 90)" python3 bench/swiglu.py 2>&1 | grep -v Warning | tee "$OUT/swiglu.txt"
           QWEN_SERVE_TRITON_SWIGLU=1 timeout "$(left 110)" python3 bench/engine_check.py \
             --ckpt $CKPT 2>&1 | grep -v Warning | tail -4
           for on in 0 1; do
             echo "-- prefill profile, QWEN_SERVE_TRITON_SWIGLU=$on"
             QWEN_SERVE_TRITON_SWIGLU=$on timeout "$(left 90)" python3 bench/prefill_profile.py \
               --ckpt $CKPT --prompt 1024 --top 12 2>&1 | grep -v Warning \
               | tee "$OUT/ttft_swiglu$on.txt" | tail -20
           done ;;
    sampling) for root in "$OLD" .; do  # Qwen3's default sampling (top_k 20, top_p 0.95)
             name=$([ "$root" = . ] && echo new || echo old)
             timeout "$(left 200)" python3 bench/serve.py --ckpt $CKPT --skip-peer \
               --tokenizer-from .benchassets/tokenizer --concurrency 1 64 --sampling qwen3 \
               --server-root "$root" --out "$OUT/sampling_$name" 2>&1 | grep -v "Warn\|Writing" \
               | tee "$OUT/sampling_$name.log" | tail -6
           done ;;
    serveab) for root in "$OLD" .; do  # greedy serving, $OLD then this tree ($SERVE_ARGS: flags)
             name=$([ "$root" = . ] && echo new || echo old)
             timeout "$(left 200)" python3 bench/serve.py --ckpt $CKPT --skip-peer \
               --tokenizer-from .benchassets/tokenizer --concurrency ${SERVE_CONC:-1 64 256} \
               --prompt-tokens ${SERVE_PROMPT:-1024} --requests-per-concurrency ${SERVE_RPC:-2} \
               --server-args="${SERVE_ARGS:-}" --server-root "$root" --out "$OUT/serveab_$name" \
               2>&1 | grep -v "Warn\|Writing" > "$OUT/serveab_$name.log"
             echo "-- serve $name ($root) ${SERVE_ARGS:-}"; grep "^|" "$OUT/serveab_$name.log" | tail -5
           done ;;
    ttftab) cp bench/prefill_profile.py "$OLD/bench/"  # this tree's script (--repeats) in both
           for round in $(seq ${TTFT_ROUNDS:-1}); do for root in . "$OLD"; do  # alternating trees
             name=$([ "$root" = . ] && echo new || echo old)$round; t0=$SECONDS
             (cd "$root" && timeout "$(left 100)" python3 bench/prefill_profile.py --ckpt $CKPT \
               --prompt 1024 --top 14 --repeats ${TTFT_REPEATS:-3} 2>&1) | grep -v Warning \
               > "$OUT/ttft_$name.txt"
             echo "-- prefill profile, $name ($root): $((SECONDS - t0)) s with start-up"
             grep -v "^| kernel\|^|---" "$OUT/ttft_$name.txt" | tail -24
           done; done ;;
    httpab) for h in h11 httptools; do  # the HTTP parser, this tree ($SERVE_ARGS: more flags)
             timeout "$(left 220)" python3 bench/serve.py --ckpt $CKPT --skip-peer \
               --tokenizer-from .benchassets/tokenizer --concurrency 1 64 256 \
               --server-args="--http $h ${SERVE_ARGS:-}" --out "$OUT/http_$h" 2>&1 \
               | grep -v "Warn\|Writing" > "$OUT/http_$h.log"
             echo "-- serve --http $h ${SERVE_ARGS:-}"; grep "^|" "$OUT/http_$h.log" | tail -5
           done ;;
    attn)  for part in prefill decode; do  # the attention kernels against torch SDPA
             echo "-- $part (128-token pages)"
             timeout "$(left 150)" python3 bench/kernels.py --only $part --out "$OUT/attn_$part" \
               2>&1 | grep -v Warning | grep "^| \|correctness" | tail -12
           done ;;
    ttft)  timeout "$(left 90)" python3 bench/prefill_profile.py --ckpt $CKPT --prompt 1024 --top 20 \
             2>&1 | grep -v Warning | tee "$OUT/ttft_profile.txt" | tail -40 ;;
    peer)  timeout "$(left 420)" python3 bench/serve.py --ckpt $CKPT --tokenizer-from .benchassets/tokenizer \
             --concurrency 1 64 256 --server-args="--api-server-count 2" --peer-concurrency 1 64 \
             --peer-time-cap 40 --out "$OUT/peer" 2>&1 | grep -v "Warn\|Writing" > "$OUT/peer.log"
           grep "^|" "$OUT/peer.log" | tail -20 ;;
    front) python3 -c "from bench.common import random_qwen3_checkpoint as r; \
             r('$CKPT', tokenizer_from='.benchassets/tokenizer')"  # (the tokenizer too: check's has none)
           # $OLD (tiktoken encoder), this tree, this tree with the engine polling after its work,
           # this tree with 5 ms between requests (whether an idle gap slows the engine's part)
           for v in ${FRONT:-old new poll gap}; do
             d=.; a=(); g=0.3
             case $v in old) d=$OLD ;; poll) a=(--engine-idle-poll-ms 1000) ;; gap) g=0.005 ;; esac
             echo "-- front $v"
             (cd "$d" && timeout "$(left 150)" python3 bench/frontend_latency.py --requests 20 \
               --prompt-tokens 1024 --gap $g -- --model $CKPT "${a[@]}") 2>&1 | grep -v Warning \
               | tee "$OUT/front-$v.txt" | tail -22
           done ;;
    mergeab) TRITON_INTERPRET=0 timeout "$(left 150)" python3 -m pytest -q -p no:cacheprovider \
             tests/kernels/test_gemv_merge.py 2>&1 | tail -3
           timeout "$(left 120)" python3 bench/gemv.py --fused --fused-shapes "0.6B o+merge" \
             --write-table --budget-s 60 --out "$OUT" 2>&1 | grep -v Warning | grep "^| \|wrote" | tail -5
           force_fused 'attn_merge:1024,2048'
           for round in $(seq ${MERGE_ROUNDS:-1}); do
             for v in old off on; do
               d=.; sw=1; [ $v = old ] && d=$OLD; [ $v = off ] && sw=0
               QWEN_SERVE_FUSED_MERGE_GEMV=$sw timeout "$(left 80)" python3 bench/decode_profile.py \
                 --tree $d --ckpt $CKPT --batch 1 64 --top 8 --label "$v$round" 2>&1 \
                 | grep -v Warning | grep -E '^\||"tpot_ms"' | cut -c1-300 | head -24
             done
           done
           timeout "$(left 110)" python3 bench/engine_check.py --ckpt $CKPT 2>&1 | grep -v Warning \
             | tail -5; restore_fused ;;
    splits) timeout "$(left 60)" python3 bench/decode_profile.py --tree $OLD --ckpt $CKPT \
             --batch 1 4 --top 6 --label old 2>&1 | grep -v Warning | grep -E '"tpot_ms"' | cut -c1-330
           for n in ${SPLITS:-64 16 4 1}; do
             QWEN_SERVE_DECODE_MAX_SPLITS=$n timeout "$(left 60)" python3 bench/decode_profile.py \
               --tree . --ckpt $CKPT --batch 1 4 --top 6 --label "max_splits=$n" 2>&1 \
               | grep -v Warning | grep -E '"tpot_ms"' | cut -c1-330
           done ;;
    qkvrope) TRITON_INTERPRET=0 timeout "$(left 120)" python3 -m pytest -q -p no:cacheprovider \
             tests/kernels/test_gemv_qk_rope.py 2>&1 | tail -3
           timeout "$(left 150)" python3 bench/gemv.py --fused --out "$OUT" \
             --fused-shapes "0.6B qkv+norm+rope" "0.6B qkv+norm" 2>&1 | grep -v Warning \
             | tee "$OUT/qkvrope_sweep.txt" | grep -v '^{' | tail -12 ;;
    qkvab) [ "${QKV_SWEEP:-1}" = 1 ] && timeout "$(left 150)" python3 bench/gemv.py --fused \
             --write-table --out "$OUT" --fused-shapes "0.6B qkv+norm+rope" 2>&1 \
             | grep -v Warning | tee "$OUT/qkvab_sweep.txt" | grep -v '^{' | tail -6
           # the A/B runs the fusion whatever the sweep said (the swept table is in $OUT as is;
           # the table the device reads: its own, or its architecture's)
           force_fused 'qkv_rope:4096,1024'
           for r in $(seq "${QKV_ROUNDS:-2}"); do
             for v in old off on; do
               d=.; sw=1; [ $v = old ] && d=$OLD; [ $v = off ] && sw=0
               QWEN_SERVE_FUSED_QKV_ROPE_GEMV=$sw timeout "$(left 120)" python3 \
                 bench/decode_profile.py --tree $d --ckpt $CKPT --batch ${QKV_BATCHES:-1 2 4 16} \
                 --top 8 \
                 --label "$v$r" 2>&1 | grep -v Warning | grep -E '"tpot_ms"' | cut -c1-400
             done
           done
           timeout "$(left 110)" python3 bench/engine_check.py --ckpt $CKPT 2>&1 | grep -v Warning \
             | tee "$OUT/check.txt" | tail -4; restore_fused ;;
    gridbar) TRITON_INTERPRET=0 timeout "$(left 120)" python3 -m pytest -q -p no:cacheprovider \
             tests/kernels/test_grid_barrier_probe.py 2>&1 | tail -2
           IFS=';' read -ra runs <<< "${GRIDBAR:---tiles 16 8 16 8;--tiles 32 8 32 8;--programs 264}"
           for v in "${runs[@]}"; do
             echo "-- grid_barrier_probe.py $v"
             timeout "$(left 90)" python3 bench/grid_barrier_probe.py $v 2>&1 | grep -v Warning \
               | tee -a "$OUT/gridbar.txt" | grep -v "^|---\|^| variant" | tail -5
           done ;;
    layer) TRITON_INTERPRET=0 timeout "$(left 120)" python3 -m pytest -q -p no:cacheprovider \
             tests/kernels/test_persistent_layer_probe.py 2>&1 | tail -2
           timeout "$(left 120)" python3 bench/persistent_layer_probe.py ${LAYER_ARGS:-} 2>&1 \
             | grep -v Warning | tee "$OUT/layer_probe.txt" | tail -8
           timeout "$(left 90)" python3 bench/decode_profile.py --tree . --ckpt $CKPT --batch 1 \
             --top 8 --label engine 2>&1 | grep -v Warning | grep -E '"tpot_ms"' | cut -c1-400 ;;
    persist) TRITON_INTERPRET=0 timeout "$(left 150)" python3 -m pytest -q -p no:cacheprovider \
             tests/kernels/test_persistent_layer_probe.py tests/kernels/test_grid_barrier_probe.py \
             tests/unit/test_persistent_decode.py -rf --tb=line 2>&1 | tail -8
           for r in $(seq "${PERSIST_ROUNDS:-2}"); do for on in 0 1; do
             QWEN_SERVE_PERSISTENT_DECODE=$on timeout "$(left 90)" python3 bench/decode_profile.py \
               --tree . --ckpt $CKPT --batch 1 --top 8 --label "persistent=$on/$r" 2>&1 \
               | grep -v Warning | grep -E '"tpot_ms"' | cut -c1-400
           done; done
           QWEN_SERVE_PERSISTENT_DECODE=1 timeout "$(left 110)" python3 bench/engine_check.py \
             --ckpt $CKPT 2>&1 | grep -v Warning | tail -4 ;;
    persistab) [ "${PERSIST_TESTS:-1}" = 0 ] || TRITON_INTERPRET=0 timeout "$(left 150)" \
             python3 -m pytest -q -p no:cacheprovider tests/kernels/test_persistent_layer_probe.py \
             tests/kernels/test_grid_barrier_probe.py tests/unit/test_persistent_decode.py -rf \
             --tb=line 2>&1 | tail -8
           # engine variants "PROMPT SWITCH [VAR=VALUE ...]" (the layout knobs of
           # engine.layers.kernel_switches.persistent_options), ';'-separated
           IFS=';' read -ra VARIANTS <<< "${PERSIST_ENGINE:-128 0;128 -;448 -;1024 0;1024 -;2000 0;2000 -}"
           for v in "${VARIANTS[@]}"; do
             set -- $v; tree=.
             if ! [[ $1 =~ ^[0-9]+$ ]]; then tree=$1; shift; fi  # a leading tree: "$OLD 128 0"
             p=$1; on=$2; shift 2
             # SWITCH "-": the variable unset (the default path, its spill bound applied)
             if [ "$on" = - ]; then sw=(-u QWEN_SERVE_PERSISTENT_DECODE); else
               sw=(QWEN_SERVE_PERSISTENT_DECODE=$on); fi
             # (120 s: a cold machine's first persistent row compiles the kernel's layouts)
             env "${sw[@]}" "$@" timeout "$(left 120)" python3 \
               bench/decode_profile.py --tree $tree --ckpt $CKPT --batch 1 --steps 64 \
               --prompt-tokens $p --top 2 --label "$tree prompt=$p persistent=$on $*" 2>&1 \
               | grep -E '"tpot_ms"|Error' | cut -c1-260
             rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || echo "-- row '$v' ended with status $rc (124: timeout)"
           done
           env QWEN_SERVE_PERSISTENT_DECODE=1 ${PERSIST_CHECK:-} timeout "$(left 110)" python3 \
             bench/engine_check.py --ckpt $CKPT 2>&1 | grep -v Warning | tail -6
           IFS=";" read -ra PROBES <<< "${PERSIST_PROBE---layouts 1000 1010 10001 10101}"  # ("": no probe)
           for args in "${PROBES[@]}"; do
             timeout "$(left 100)" python3 bench/persistent_layer_probe.py --warps 8 $args 2>&1 \
               | grep -E "^\| [0-9]|rror|failed" | tee -a "$OUT/persistab_probe.txt"
           done ;;
    offline) timeout "$(left 150)" python3 bench/offline.py --ckpt $CKPT --skip-hf 2>&1 \
             | grep -v Warning | tee "$OUT/offline.txt" | tail -6 ;;
    l2pf)  TRITON_INTERPRET=0 timeout "$(left 150)" python3 -m pytest -q -p no:cacheprovider \
             tests/kernels/test_l2_prefetch.py tests/kernels/test_pdl.py 2>&1 | tail -4
           timeout "$(left 90)" python3 bench/l2_prefetch_probe.py 2>&1 | grep -v Warning \
             | tee "$OUT/l2pf_probe.txt" | tail -16 ;;
    wideab) TRITON_INTERPRET=0 timeout "$(left 90)" python3 -m pytest -q -p no:cacheprovider \
             tests/kernels/test_gemv.py -rf --tb=line 2>&1 | tail -4
           wide() {  # $1: a label; the 32- and 64-row decode steps, then serving at c=64
             timeout "$(left 90)" python3 bench/decode_profile.py --tree . --ckpt $CKPT \
               --batch 32 64 --steps 32 --prompt-tokens 1024 --top 8 --label "$1" 2>&1 \
               | grep -E '"tpot_ms"|Error' | cut -c1-700
             [ "${WIDE_SERVE:-1}" = 0 ] || timeout "$(left 120)" python3 bench/serve.py \
               --ckpt $CKPT --skip-peer --tokenizer-from .benchassets/tokenizer --concurrency 64 \
               --prompt-tokens 1024 --out "$OUT/wideab_$1" 2>&1 | grep -E "^\| qwen|Error"
           }
           wide cublas
           timeout "$(left 200)" python3 bench/gemv.py --sweep --ms 64 --shapes "0.6B qkv" \
             "0.6B o" "0.6B gate_up" "0.6B down" --write-table --out "$OUT" 2>&1 \
             | grep -E "^\| 0.6B|rror|^wrote" | tee "$OUT/wideab_sweep.txt"
           # the second round only where the sweep finished and wrote a 64-row entry (a sweep cut
           # by the budget writes nothing: the same runs would time cuBLAS again)
           if grep -qs '"m64"' "$OUT"/gemv_*.json; then wide gemv64
           else echo "-- wideab: no m64 table row written (sweep cut or failed): second round skipped"; fi ;;
    *)     echo "unknown stage $stage (tests check dense decode decprof fusedcheck fp8 ab lc fp8ab swiglu sampling serveab ttftab httpab attn ttft peer front l2pf qkvrope qkvab splits mergeab gridbar layer persist persistab wideab)"; exit 2 ;;
  esac
  stamp "$stage"
done
