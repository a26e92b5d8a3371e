"""GPU check of prompt log-probabilities in the production configuration (CUDA graphs, Triton
attention, async scheduling, chunked prefill, prefix caching) against transformers.

Usage (on the GPU): ``python bench/prompt_logprobs_check.py [--ckpt DIR]`` (Qwen3-0.6B
architecture, random weights, vocabulary 151,936). For each engine dtype (float32, bfloat16) it
scores prompts of several lengths (up to 4,000 tokens, spread over 512-token steps) next to plain
requests, and prints per prompt the largest |logprob - reference| over its positions, the share
of positions whose top-1 alternative equals the reference argmax, the step count and the peak
CUDA memory; the reference is transformers' float32 forward. It also checks that the plain
requests' greedy tokens equal a run without the scoring requests (steps that score run eagerly,
the others keep their CUDA graphs; reported, not failed: random weights give near-flat
distributions whose argmax may flip with the batch's GEMM shapes). Exits non-zero when a check
fails (float32: error <= 1e-3; bfloat16: <= 0.15, bf16 rounding of the logits).
``--device cpu --ckpt TINY --lengths 2 17 40`` runs the same logic on the CPU (a smoke test).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import random_qwen3_checkpoint
from engine.core.config import EngineConfig
from engine.core.request import SamplingParams
from engine.worker.build import build_engine

LENGTHS = [2, 17, 300, 1500, 4000]
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.15}


def make_engine(ckpt: str, dtype: str, device: str):
    return build_engine(
        EngineConfig(
            model=ckpt,
            device=device,
            dtype=dtype,
            max_model_len=8192,
            block_size=16,  # the block count below is sized for 16-token blocks
            num_kv_blocks=2048,
            max_num_seqs=32,
            max_num_batched_tokens=512,
        ),
        eos_token_ids=frozenset(),
    )


def run(eng, requests):
    """Step to the end; returns ({id: first output}, {id: all tokens}, steps)."""
    for rid, prompt, params in requests:
        eng.add_request(rid, prompt, params)
    first, tokens, steps = {}, {rid: [] for rid, _, _ in requests}, 0
    while eng.has_unfinished():
        outs, _ = eng.step()
        steps += 1
        for o in outs:
            first.setdefault(o.request_id, o)
            tokens[o.request_id] += o.new_token_ids
    return first, tokens, steps


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default=None, help="checkpoint dir (default: random Qwen3-0.6B)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    args = ap.parse_args()
    dev = args.device
    cuda = dev.startswith("cuda")
    ckpt = args.ckpt or str(
        random_qwen3_checkpoint(Path(tempfile.gettempdir()) / "qwen3-0.6b-random", "bfloat16")
    )
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32).to(dev).eval()
    vocab = hf.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(0, vocab, (n,), generator=gen).tolist() for n in args.lengths}
    plain = [torch.randint(0, vocab, (50,), generator=gen).tolist() for _ in range(4)]
    refs = {}
    with torch.no_grad():
        for n, p in prompts.items():
            logits = hf(torch.tensor([p], device=dev)).logits[0].float()
            refs[n] = torch.log_softmax(logits, dim=-1).cpu()
    del hf
    if cuda:
        torch.cuda.empty_cache()

    ok = True
    print("| dtype | prompt | max abs err | top-1 agree | steps | peak MiB | plain changed |")
    print("|---|---|---|---|---|---|---|")
    for dtype in ("float32", "bfloat16") if cuda else ("float32",):
        eng = make_engine(ckpt, dtype, dev)
        greedy = SamplingParams(temperature=0.0, max_tokens=24)
        plain_reqs = [(f"plain{i}", p, greedy) for i, p in enumerate(plain)]
        _, alone, _ = run(eng, plain_reqs)
        for n, p in prompts.items():
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            score = SamplingParams(max_tokens=1, prompt_logprobs=5)
            mixed = [(f"s{n}", p, score)] + [(f"m{n}-{r}", q, sp) for r, q, sp in plain_reqs]
            first, tokens, steps = run(eng, mixed)
            entries = first[f"s{n}"].prompt_logprobs
            ref = refs[n]
            assert len(entries) == n - 1, (n, len(entries))
            err = max(
                (abs(lp - ref[j, p[j + 1]].item()) for j, (lp, _, _) in enumerate(entries)),
                default=0.0,
            )
            agree = sum(
                alts[0][0] == int(ref[j].argmax()) for j, (_, _, alts) in enumerate(entries)
            )
            share = agree / max(1, len(entries))
            peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else 0.0
            changed = sum(tokens[f"m{n}-{r}"] != alone[r] for r, _, _ in plain_reqs)
            print(
                f"| {dtype} | {n} | {err:.2e} | {share:.3f} | {steps} | {peak:.0f} "
                f"| {changed}/{len(plain_reqs)} |"
            )
            if err > TOLERANCE[dtype]:
                ok = False
        del eng
        if cuda:
            torch.cuda.empty_cache()
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
