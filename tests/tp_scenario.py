"""One tensor-parallel engine run for the tests, in a process of its own (it becomes rank 0 and
spawns the other ranks): ``python -m tests.tp_scenario MODEL_DIR TP OUT.pt [engine options]``.

Runs, on one engine: 8 greedy prompts of 32 tokens with a cache too small for all (preemption),
synchronously and then with async scheduling, recording the logits every step hands the sampler
(rank 0's gathered logits, float32) per request; then, with async scheduling, the same prompts
with penalties (deferred sampling: ``before_sampling``), sampled-token logprobs and prompt
logprobs ("extras"); then saves ``{"ids": ..., "logits": ..., "extras": ..., "preemptions": ...,
"layout": ...}`` with ``torch.save``. The same function runs in the test
process for TP=1, so both sides go through the same steps.
"""

from __future__ import annotations

import json
import sys

import torch

from engine.core.config import EngineConfig
from engine.core.request import SamplingParams
from engine.worker.build import build_engine

#: prompt lengths of the 8 concurrent requests (as test_model_vs_transformers)
LENGTHS = [3, 9, 17, 24, 31, 40, 12, 5]
NUM_TOKENS = 32


def prompts(vocab: int, seed: int = 11) -> list[list[int]]:
    """The 8 prompts (random ids below ``vocab``, lengths :data:`LENGTHS`)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


def engine_config(model: str, tp: int, **overrides) -> EngineConfig:
    """16 KV blocks of 16 tokens for 8 requests of up to 72 tokens: preemption."""
    cfg = dict(
        model=model,
        num_kv_blocks=16,
        block_size=16,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
        tensor_parallel_size=tp,
    )
    cfg.update(overrides)
    return EngineConfig(**cfg)


def run(config: EngineConfig, vocab: int) -> dict:
    """The scenario on a fresh engine; the engine is shut down at the end."""
    eng = build_engine(config, eos_token_ids=frozenset())
    try:
        runner = getattr(eng.executor, "runner", eng.executor)
        sampler = runner.sampler
        logits: dict[str, list[torch.Tensor]] = {}
        tag = {"mode": ""}

        def recording(lg, requests, *args, **kwargs):
            for row, req in enumerate(requests):
                key = f"{tag['mode']}:{req.request_id.rsplit('-', 1)[-1]}"
                logits.setdefault(key, []).append(lg[row].float().clone())
            return sampler(lg, requests, *args, **kwargs)

        runner.sampler = recording
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS)
        out = {}
        for mode, overlap in (("sync", False), ("async", True)):
            tag["mode"] = mode
            eng.async_scheduling = overlap
            out[mode] = eng.generate(prompts(vocab), params)
            kv = eng.kv_cache_manager
            assert kv.num_free_blocks == kv.num_blocks
        tag["mode"] = "extras"
        eng.async_scheduling = True
        extra = SamplingParams(
            temperature=0.0,
            max_tokens=12,
            logprobs=2,
            prompt_logprobs=2,
            frequency_penalty=0.7,
            repetition_penalty=1.2,
        )
        reqs = [eng.add_request(f"extras-{i}", p, extra) for i, p in enumerate(prompts(vocab))]
        while eng.has_unfinished():
            eng.step()
        return {
            "ids": out,
            "extras": [(r.output_token_ids, r.prompt_logprobs) for r in reqs],
            "logits": {k: torch.stack(v) for k, v in logits.items()},
            "preemptions": eng.scheduler.num_preemptions,
            "layout": [r.__dict__ for r in eng.limits.ranks],
        }
    finally:
        eng.shutdown()


def main(argv: list[str]) -> int:
    """``MODEL_DIR TP OUT.pt [JSON engine overrides]``: run the scenario, save its result."""
    model, tp, out = argv[0], int(argv[1]), argv[2]
    overrides = json.loads(argv[3]) if len(argv) > 3 else {}
    vocab = json.load(open(f"{model}/config.json"))["vocab_size"]
    torch.set_num_threads(1)
    torch.save(run(engine_config(model, tp, **overrides), vocab), out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
