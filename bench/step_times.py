"""Engine step times by step composition, for long-context scheduling (issue 20).

Usage (on the GPU)::

    python bench/step_times.py --ckpt /tmp/qwen3-0.6b-random [--prompt 32000] [--concurrency 8]
        [--requests 16] [--max-tokens 64] [--profile] [-- EngineConfig overrides as KEY=VALUE]

A closed loop like ``bench/serve.py`` at one concurrency, run on the engine in this process
with synchronous scheduling (each ``step()`` is timed from its start to its outputs, GPU work
included, ``torch.cuda.synchronize`` after it): ``--concurrency`` requests of ``--prompt``
random tokens start together and each finished request is replaced by a new one until
``--requests`` have run (every prompt distinct, prefix caching off). Every step is classified by
what the scheduler put in it: decode rows, prompt rows and the longest cached prefix a prompt
chunk attends to. Prints a table of mean step time per
class, the requests' TTFT / TPOT (from the step clock) and output tok/s. ``--profile`` runs
torch's profiler over one mixed step whose chunk attends to more than half the prompt (and one
pure decode step) and prints their top kernels by CUDA time.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _bucket(x: int, edges: tuple[int, ...]) -> str:
    for e in edges:
        if x <= e:
            return f"<={e}"
    return f">{edges[-1]}"


def _value(text: str):
    """``None``, ``True``/``False``, an int, a float, or the string itself."""
    if text in ("None", "True", "False"):
        return {"None": None, "True": True, "False": False}[text]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _overrides(items: list[str]) -> dict:
    return {key: _value(value) for key, _, value in (i.partition("=") for i in items)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="/tmp/qwen3-0.6b-random")
    ap.add_argument("--prompt", type=int, default=32000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=40960)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--label", default="")
    ap.add_argument("overrides", nargs="*", help="EngineConfig fields, KEY=VALUE")
    args = ap.parse_args()

    import torch

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    from engine.core.config import EngineConfig
    from engine.core.request import SamplingParams
    from engine.worker.build import build_engine

    fields = dict(
        model=args.ckpt,
        device=args.device,
        dtype=torch.bfloat16 if args.device.startswith("cuda") else torch.float32,
        max_model_len=args.max_model_len,
        max_num_seqs=256,
        enable_prefix_caching=False,
        async_scheduling=False,
    )
    fields.update(_overrides(args.overrides))
    engine = build_engine(EngineConfig(**fields))
    sched = engine.scheduler
    rng = random.Random(7)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    started = 0

    def add() -> None:
        nonlocal started
        ids = [rng.randrange(1000, 30000) for _ in range(args.prompt)]
        engine.add_request(f"r{started}", ids, params)
        started += 1

    # warm-up: one short request through prefill and decode
    engine.add_request("warm", [rng.randrange(1000, 30000) for _ in range(300)], params)
    while engine.has_unfinished():
        engine.step()
    sync()

    composition: dict = {}
    real_schedule = sched.schedule

    def schedule():
        batch = real_schedule()
        dec = rows = chunk_ctx = 0
        for r, n in zip(batch.requests, batch.num_new_tokens):
            c = r.num_computed_tokens
            if r.num_tokens - c == 1:
                dec += 1
            else:
                rows += n
                chunk_ctx = max(chunk_ctx, c)
        composition.update(dec=dec, rows=rows, chunk_ctx=chunk_ctx)
        return batch

    sched.schedule = schedule
    for _ in range(min(args.concurrency, args.requests)):
        add()
    classes: dict[tuple, list[float]] = defaultdict(list)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    arrival: dict[str, float] = {}
    count: dict[str, int] = defaultdict(int)
    for rid in list(sched.requests):
        arrival[rid] = time.perf_counter()
    profiled = set()
    t_start = time.perf_counter()
    while engine.has_unfinished():
        prof = None
        kind = None
        if args.profile:
            # decide from the next step's likely shape: profile when a chunk is deep in a prompt
            pending = [r for r in sched.running if r.num_tokens - r.num_computed_tokens > 1]
            decoding = [r for r in sched.running if r.num_tokens - r.num_computed_tokens == 1]
            if (
                "mixed" not in profiled
                and decoding
                and any(r.num_computed_tokens > args.prompt // 2 for r in pending)
            ):
                kind = "mixed"
            elif (
                "decode" not in profiled
                and len(decoding) >= min(args.concurrency, args.requests)
                and not pending
                and not sched.waiting
            ):
                kind = "decode"
            if kind:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                prof.__enter__()
        t0 = time.perf_counter()
        outputs, _ = engine.step()
        sync()
        t1 = time.perf_counter()
        if prof is not None:
            prof.__exit__(None, None, None)
            profiled.add(kind)
            print(f"\n-- profile of a {kind} step: {composition}")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
        comp = dict(composition)
        if comp["rows"] and comp["dec"]:
            key = (
                "mixed",
                comp["dec"],
                _bucket(comp["rows"], (16, 64, 256, 1024)),
                _bucket(comp["chunk_ctx"], (1024, 8192, 16384, 32768)),
            )
        elif comp["rows"]:
            key = ("prefill", 0, _bucket(comp["rows"], (16, 64, 256, 1024, 8192)), "")
        else:
            key = ("decode", comp["dec"], "", "")
        if prof is None:  # a profiled step's time is not representative
            classes[key].append(1e3 * (t1 - t0))
        for o in outputs:
            if o.new_token_ids:
                rid = o.request_id
                first.setdefault(rid, t1)
                last[rid] = t1
                count[rid] += len(o.new_token_ids)
            if o.finished and started < args.requests:
                add()
                arrival[f"r{started - 1}"] = t1
    wall = time.perf_counter() - t_start
    label = args.label or " ".join(args.overrides) or "default"
    print(
        f"\n[{label}] prompt {args.prompt}, concurrency {args.concurrency}, "
        f"{args.requests} requests"
    )
    print("| step | decodes | prompt rows | chunk prefix | steps | mean ms | median ms |")
    print("|---|---|---|---|---|---|---|")
    for key in sorted(classes, key=lambda k: (k[0], k[1], k[2], k[3])):
        ts = classes[key]
        print(
            f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {len(ts)} "
            f"| {statistics.mean(ts):.2f} | {statistics.median(ts):.2f} |"
        )
    rids = [r for r in first if r.startswith("r")]
    ttft = [1e3 * (first[r] - arrival[r]) for r in rids]
    tpot = [1e3 * (last[r] - first[r]) / max(1, count[r] - 1) for r in rids]
    out = sum(count[r] for r in rids)
    print(
        f"[{label}] TTFT mean/median {statistics.mean(ttft):.0f}/{statistics.median(ttft):.0f} ms, "
        f"TPOT mean/median {statistics.mean(tpot):.2f}/{statistics.median(tpot):.2f} ms, "
        f"{out / wall:.0f} out tok/s over {wall:.1f} s"
    )


if __name__ == "__main__":
    main()
