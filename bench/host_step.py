"""Host CPU time of one engine step at batch 256, with the device faked (runs on the CPU).

Usage: ``python bench/host_step.py --tree DIR [--ckpt CKPT]`` (``DIR``: a source tree of this
project, the flat pre-restructure layout included; default checkpoint: the embedded model).
The real scheduler, KV cache manager, ``prepare_inputs``, host-to-device staging and sampler
run; the model forward is skipped and the sampler sees ``[N, 512]`` zero logits, so what is
timed is the Python work the engine core does per step, which async scheduling must hide
behind the GPU. 256 greedy requests of 100-1,000 prompt tokens decode 400 tokens each; prints
the median and p90 CPU time per step (``time.process_time``) after the first 50 steps, and the
garbage-collector runs per generation.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--ckpt", default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(args.tree).resolve()))
    import torch

    torch.set_num_threads(1)
    try:
        import engine.worker.model_runner as mr
        from engine.core.config import EngineConfig
        from engine.core.request import SamplingParams
        from engine.loader.embedded import ensure_embedded_checkpoint
        from engine.worker.build import build_engine as build

        new = True
    except ImportError:  # the layout before the restructure
        import engine.model_runner as mr
        from engine.config import EngineConfig
        from engine.embedded import ensure_embedded_checkpoint
        from engine.engine import LLMEngine as build
        from engine.request import SamplingParams

        new = False
    ckpt = args.ckpt or str(ensure_embedded_checkpoint())
    cfg = EngineConfig(
        model=ckpt,
        num_kv_blocks=20000,
        max_num_seqs=256,
        max_model_len=4096,
        enable_prefix_caching=False,
        async_scheduling=True,
    )
    eng = build(cfg, eos_token_ids=frozenset())
    runner = eng.executor if new else eng.runner
    names = (
        "input_ids",
        "positions",
        "slot_mapping",
        "block_tables",
        "seq_lens",
        "cu_seqlens_q",
        "logits_indices",
    )

    def fake_launch(batch, eos, prev=None):
        rows_prev = prev.rows if prev is not None else None
        inp = mr.prepare_inputs(batch, runner.config.block_size, runner.block_tables, rows_prev)
        if new:
            runner.staging.next_step()
            inp.to_device(runner.staging, prev.token_ids if prev is not None else None)
        else:
            runner._staging_parity ^= 1
            for name in names:
                runner._to_device(getattr(inp, name), name)
        samples = runner.sampler(
            torch.zeros(len(inp.sample_requests), 512), inp.sample_requests, eos
        )
        rows = {r.request_id: i for i, r in enumerate(inp.sample_requests)}
        return mr.StepHandle(inp.sample_requests, samples.to_host(), samples.token_ids, rows)

    runner.launch = fake_launch
    rng = random.Random(0)
    for i in range(256):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(100, 1000))]
        eng.add_request(
            f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        )
    collections = [s["collections"] for s in gc.get_stats()]
    times = []
    while eng.has_unfinished():
        t = time.process_time()
        eng.step()
        times.append(time.process_time() - t)
    steady = sorted(times[50:])
    gcs = [s["collections"] - c for s, c in zip(gc.get_stats(), collections)]
    median, p90 = statistics.median(steady), steady[int(0.9 * len(steady))]
    print(
        f"{'new' if new else 'old'} layout ({args.tree}): {len(times)} steps, CPU per step median "
        f"{1e3 * median:.3f} ms, p90 {1e3 * p90:.3f} ms; gc runs per generation {gcs}"
    )


if __name__ == "__main__":
    main()
