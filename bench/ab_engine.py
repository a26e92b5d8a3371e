"""One engine-only measurement of the engine in a given source tree (for A/B runs of two trees).

Usage (on the GPU): ``python bench/ab_engine.py --tree DIR --ckpt CKPT [--seed N]``. Imports the
engine from ``DIR`` (this repository's layout, or the flat ``engine/`` layout before the
restructure), builds it with the server's defaults (bf16, CUDA graphs, async scheduling, token
budget 1024, prefix caching off so every prompt is cold) and prints one JSON line:

* ``offline_tok_s``: output tokens/s on nano-vllm's workload (256 requests, prompts and outputs of
  100-1,024 tokens, temperature 0.6, ignore_eos);
* ``ttft_ms``: median over 5 prompts of 1,024 distinct random tokens of the time to the first
  sampled token at batch 1 (engine only, no HTTP);
* ``tpot_ms``: mean decode time per token of those 5 requests (64 tokens each).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path


def load_engine_api(tree: Path):
    """(build(config, eos) -> engine, EngineConfig, SamplingParams) of the tree's engine."""
    sys.path.insert(0, str(tree))
    try:
        from engine.core.config import EngineConfig
        from engine.core.request import SamplingParams
        from engine.worker.build import build_engine

        return (
            (lambda cfg: build_engine(cfg, eos_token_ids=frozenset())),
            EngineConfig,
            SamplingParams,
        )
    except ImportError:  # the layout before the restructure
        from engine.config import EngineConfig
        from engine.engine import LLMEngine
        from engine.request import SamplingParams

        return (lambda cfg: LLMEngine(cfg, eos_token_ids=frozenset())), EngineConfig, SamplingParams


def server_default_engine(build, EngineConfig, ckpt: str, device: str, **overrides):
    """The tree's engine with the server's defaults (CUDA graphs, async scheduling, token budget
    1024), bf16 on CUDA (float32 elsewhere), 4096-token window, 256 sequences, prefix caching
    off so that every prompt is cold; ``build``/``EngineConfig`` from :func:`load_engine_api`;
    ``overrides``: further ``EngineConfig`` fields (``quantization``, ``load_format``)."""
    import torch

    cuda = device.startswith("cuda")
    return build(
        EngineConfig(
            model=ckpt,
            device=device,
            dtype=torch.bfloat16 if cuda else torch.float32,
            max_model_len=4096,
            max_num_seqs=256,
            enable_prefix_caching=False,
            **overrides,
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--tree", required=True, help="source tree whose engine/ and kernels/ are measured"
    )
    ap.add_argument("--ckpt", required=True)
    ap.add_argument(
        "--seed", type=int, default=0, help="seed of the latency prompts (distinct per run)"
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--num-seqs", type=int, default=256, help="requests of the offline workload")
    args = ap.parse_args()
    tree = Path(args.tree).resolve()
    build, EngineConfig, SamplingParams = load_engine_api(tree)
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.common import nano_vllm_workload

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    eng = server_default_engine(build, EngineConfig, args.ckpt, args.device)
    startup = time.perf_counter() - t0
    prompts, out_lens = nano_vllm_workload(args.num_seqs)
    eng.generate([prompts[0][:64]], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in out_lens]
    sync()
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params)
    sync()
    offline_s = time.perf_counter() - t0
    total = sum(len(o) for o in outs)
    assert total == sum(out_lens), (total, sum(out_lens))

    rng = random.Random(1000 + args.seed)
    ttfts, tpots = [], []
    vocab = eng.model_config.vocab_size
    for trial in range(5):
        prompt = [rng.randint(1000, vocab - 1) for _ in range(1024)]
        eng.add_request(
            f"lat{trial}", prompt, SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True)
        )
        sync()
        t0 = time.perf_counter()
        first = None
        n_tokens = 0
        while eng.has_unfinished():
            outs, _ = eng.step()
            got = sum(len(o.new_token_ids) for o in outs)
            if got and first is None:
                first = time.perf_counter()
            n_tokens += got
        end = time.perf_counter()
        ttfts.append(1e3 * (first - t0))
        tpots.append(1e3 * (end - first) / (n_tokens - 1))
    print(
        json.dumps(
            {
                "tree": tree.name,
                "startup_s": round(startup, 1),
                "offline_tok_s": round(total / offline_s),
                "ttft_ms": round(statistics.median(ttfts), 2),
                "tpot_ms": round(statistics.mean(tpots), 3),
                "preemptions": eng.scheduler.num_preemptions,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
