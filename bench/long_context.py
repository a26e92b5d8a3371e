"""Long-context serving: 1k / 8k / 32k-token prompts at concurrency 1 and 8, before and after.

Usage (on the GPU)::

    python bench/long_context.py --ckpt /tmp/qwen3-0.6b-random \
        --tokenizer-from .benchassets/tokenizer [--trees OLD_DIR NEW_DIR] [--server-args ...]

For each source tree (default: this one) the server is started once with ``--max-model-len
40960`` (the checkpoint's window) and the levels run against it: streamed chat, 64 output tokens
(``ignore_eos``), every prompt distinct from the warm-up and from every other prompt (the prefix
cache hit rate of each level is printed and should be ~0). The table gives TTFT mean / median /
p99, TPOT mean / median, ITL p99 and output tok/s per (tree, prompt length, concurrency). The
prefill reference in the same call: transformers' forward (SDPA) of one 32k-token prompt of the
same model, timed after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.serve import make_prompts, prefix_cache_counters, run_level, wait_health  # noqa: E402

LEVELS = [(1024, 1), (1024, 8), (8192, 1), (8192, 8), (32000, 1), (32000, 8)]


def _level(spec: str) -> tuple[int, int]:
    """``"8192x8"`` -> ``(8192, 8)``, a level of :data:`LEVELS`."""
    level = tuple(int(v) for v in spec.lower().split("x"))
    if level not in LEVELS:
        raise argparse.ArgumentTypeError(f"{spec!r} is not one of {LEVELS}")
    return level


def hf_prefill_ms(ckpt: str, tokens: int, device: str) -> float:
    """Milliseconds of transformers' forward (SDPA, bf16) over one ``tokens``-token prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    model = model.to(device).eval()
    ids = torch.randint(1000, 30000, (1, tokens), device=device)
    with torch.inference_mode():
        model(ids[:, :1024])  # warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        model(ids, logits_to_keep=1)
        torch.cuda.synchronize()
    ms = 1e3 * (time.perf_counter() - t)
    del model
    torch.cuda.empty_cache()
    return ms


def run_tree(
    tree: Path, args, prompts: dict[int, list[str]], port: int, variant: str, extra_args: list[str]
) -> list[dict]:
    """Starts the server of ``tree`` with ``extra_args`` and runs every level against it; the
    rows are labelled ``tree`` and ``variant``."""
    cmd = [
        sys.executable,
        "-m",
        "server",
        "--model",
        args.ckpt,
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(args.max_model_len),
        "--served-model-name",
        "bench",
        "--log-level",
        "warning",
        *args.server_args,
        *extra_args,
    ]
    base = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": f"{tree}:{os.environ.get('PYTHONPATH', '')}",
    }
    rows = []
    with open(f"{args.out}/long_{tree.name}_{variant}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tree, env=env)
        try:
            wait_health(base, proc)
            run_level(
                base,
                "bench",
                prompts["warmup"],
                2,
                16,
                120,
                extra={"ignore_eos": True},
                client_procs=1,
            )
            for length, conc in args.levels:
                before = prefix_cache_counters(base)
                r = run_level(
                    base,
                    "bench",
                    prompts[(length, conc)],
                    conc,
                    args.max_tokens,
                    600,
                    extra={"ignore_eos": True},
                    client_procs=min(conc, 4),
                )
                after = prefix_cache_counters(base)
                queried = after[0] - before[0]
                r.update(
                    tree=tree.name,
                    variant=variant,
                    prompt=length,
                    prefix_hit_rate=(after[1] - before[1]) / queried if queried else 0.0,
                )
                rows.append(r)
                print(json.dumps(r), flush=True)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="/tmp/qwen3-0.6b-random")
    ap.add_argument("--tokenizer-from", default=None)
    ap.add_argument("--trees", nargs="*", default=[str(REPO)])
    ap.add_argument("--server-args", nargs="*", default=[])
    ap.add_argument(
        "--variants",
        nargs="*",
        default=["default="],
        help="server configurations run on every tree, each NAME=ARGS (ARGS split on spaces), "
        "e.g. 'budgets=--prefill-only-token-budget 8192'",
    )
    ap.add_argument("--max-model-len", type=int, default=40960)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--requests-per-level", type=int, default=2, help="requests per unit of concurrency"
    )
    ap.add_argument(
        "--levels",
        nargs="*",
        type=_level,
        default=LEVELS,
        help="PROMPTxCONC levels to run, e.g. 8192x8 32000x8 (default: all six); prompts stay "
        "those of the full set, so a level's texts do not depend on which levels run",
    )
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default="/tmp")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    from bench.common import random_qwen3_checkpoint

    random_qwen3_checkpoint(args.ckpt, tokenizer_from=args.tokenizer_from)
    seed = 100
    prompts: dict = {"warmup": make_prompts(args.ckpt, 4, 256, seed=seed)}
    for length, conc in LEVELS:  # distinct seeds: no prompt shares a prefix with another
        seed += 1
        prompts[(length, conc)] = make_prompts(
            args.ckpt, max(4, conc * args.requests_per_level), length, seed=seed
        )
    ref = None if args.skip_hf else hf_prefill_ms(args.ckpt, 32000, "cuda")
    rows = []
    port = 8400
    for tree in args.trees:
        for spec in args.variants:
            name, _, extra = spec.partition("=")
            rows += run_tree(Path(tree).resolve(), args, prompts, port, name, extra.split())
            port += 1
    print(
        "\n| tree | variant | prompt | conc | done | TTFT mean/med/p99 ms | TPOT mean/med ms "
        "| ITL p99 ms | out tok/s | prefix hits |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['tree']} | {r['variant']} | {r['prompt']} | {r['concurrency']} "
            f"| {r['completed']} "
            f"| {r['ttft_mean']:.1f}/{r['ttft_median']:.1f}/{r['ttft_p99']:.1f} "
            f"| {r['tpot_mean']:.2f}/{r['tpot_median']:.2f} | {r['itl_p99']:.1f} "
            f"| {r['out_tok_s']:.0f} | {100 * r['prefix_hit_rate']:.1f}% |"
        )
    if ref is not None:
        print(
            "\nprefill reference: transformers (SDPA, bf16) forward of one 32,000-token prompt: "
            f"{ref:.1f} ms"
        )


if __name__ == "__main__":
    main()
