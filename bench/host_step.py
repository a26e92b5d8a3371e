"""Host CPU time of one engine step, with the device faked (runs on the CPU).

Usage::

    python bench/host_step.py [--tree DIR] [--batch N] [--prompt-len A[:B]] [--max-tokens M]
                              [--rounds R] [--sampler triton|torch] [--no-graphs]
                              [--profile K] [--compare OLD [--repeats K]] [--ckpt CKPT]

``DIR``: a source tree of this project (default: this one; the flat pre-restructure layout is
accepted too), e.g. ``git archive main engine kernels server bench | tar -x -C /tmp/old``.
``--compare OLD`` runs OLD and ``DIR`` alternately, ``--repeats`` times each, in fresh processes
(a loaded machine drifts; interleaving keeps the drift out of the difference) and prints a
table of the runs' medians. Default checkpoint: the embedded model.

The real scheduler, KV cache manager, ``ModelRunner.launch`` (``prepare_inputs``, host-to-device
staging, the decode graphs' input copies, the sampler, the step handle) and output processing
run; only the model is faked: the forward returns a ``[T, 1]`` zero tensor, the LM head and
the decode graphs ``[N, 512]`` zero logits (the graphs, built as on CUDA, replay nothing;
``--no-graphs``: decode steps run the eager path), so what is timed is the Python work the
engine core does per step, which async scheduling must hide behind the GPU. ``--sampler
triton`` (the default) runs the sampler's CUDA branch (the Triton backend's host work:
parameter staging) with the kernel replaced by a torch argmax; ``--sampler torch`` runs the CPU
backend. What only CUDA does (pinned buffers and events of the staging, kernel launches, graph
replays) is not timed: on the CPU a staged copy is a plain tensor copy.

Workload: ``--batch`` greedy requests (random prompt lengths in ``--prompt-len``, default
``1024`` at batch 1, else ``100:1000``) decode ``--max-tokens`` tokens each (400), all added at
once; ``--rounds`` repeats it with fresh requests (default: enough rounds for about 2,000 timed
steps at batch 1). Prints the median and p90 CPU time per step (``time.process_time``) after
the first 50 steps of each round, and the garbage-collector runs per generation; ``--profile K``
runs one more round under cProfile and prints the top ``K`` functions by own time and by
cumulative time (microseconds per step).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

WARMUP_STEPS = 50
FAKE_VOCAB = 512


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--batch", type=int, default=256, help="requests decoding together")
    ap.add_argument("--prompt-len", default=None, help="A or A:B (uniform); see the docstring")
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=None, help="workload repeats (fresh requests)")
    ap.add_argument("--sampler", choices=("triton", "torch"), default="triton")
    ap.add_argument(
        "--no-graphs", action="store_true", help="decode steps eagerly (default: decode graphs)"
    )
    ap.add_argument("--profile", type=int, default=0, metavar="K", help="cProfile top K")
    ap.add_argument(
        "--compare",
        default=None,
        metavar="OLD",
        help="A/B: run OLD and --tree alternately in subprocesses (--repeats each), print a table",
    )
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if args.prompt_len is None:
        args.prompt_len = "1024" if args.batch == 1 else "100:1000"
    lo, _, hi = args.prompt_len.partition(":")
    args.prompt_range = (int(lo), int(hi or lo))
    if args.rounds is None:
        args.rounds = (
            max(1, -(-2000 // max(1, args.max_tokens - WARMUP_STEPS))) if args.batch == 1 else 1
        )
    return args


def load_tree(tree: str):
    """Import the tree's engine; returns (build, EngineConfig, SamplingParams, checkpoint fn,
    whether it has the current layout, its model_runner module)."""
    sys.path.insert(0, str(Path(tree).resolve()))
    try:
        import engine.worker.model_runner as mr
        from engine.core.config import EngineConfig
        from engine.core.request import SamplingParams
        from engine.loader.embedded import ensure_embedded_checkpoint
        from engine.worker.build import build_engine as build

        return build, EngineConfig, SamplingParams, ensure_embedded_checkpoint, True, mr
    except ImportError:  # the layout before the restructure
        import engine.model_runner as mr
        from engine.config import EngineConfig
        from engine.embedded import ensure_embedded_checkpoint
        from engine.engine import LLMEngine as build
        from engine.request import SamplingParams

        return build, EngineConfig, SamplingParams, ensure_embedded_checkpoint, False, mr


class _NoGraph:
    """A captured graph stand-in: replaying it does nothing."""

    def replay(self) -> None:
        pass


def fake_device(eng, new: bool, mr, sampler: str, graphs: bool = True) -> None:
    """Replace the model (current layout) or the whole launch (old layout) by zero outputs;
    ``graphs``: decode steps go through the runner's ``DecodeGraphs`` (input copies into its
    buffers, as on CUDA) with graphs that replay nothing and zero logits."""
    import torch

    runner = eng.executor if new else eng.runner
    if sampler == "triton":
        import kernels.sampling

        def sample_tokens(logits, temperature, seeds, offsets, out):
            return torch.argmax(logits, dim=-1, out=out)

        kernels.sampling.sample_tokens = sample_tokens
        runner.sampler.backend = "triton"
    if new:
        runner.forward = lambda step: torch.zeros(step.num_tokens, 1)
        runner.model.compute_logits = lambda hidden: torch.zeros(hidden.shape[0], FAKE_VOCAB)
        if graphs:
            from engine.worker.cuda_graph import DecodeGraphs

            g = DecodeGraphs(
                runner.model,
                runner.kv_caches,
                runner.config.max_num_seqs,
                runner.block_tables.width,
                runner.cache_info.max_model_len,
            )
            keys = g.sizes + g.twin_keys  # (the persistent twins)
            g.graphs = {s: _NoGraph() for s in keys}
            g.logits = {s: torch.zeros(s if isinstance(s, int) else 1, FAKE_VOCAB) for s in keys}
            runner.graphs = g
        return
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
        runner._staging_parity ^= 1
        for name in names:
            runner._to_device(getattr(inp, name), name)
        samples = runner.sampler(
            torch.zeros(len(inp.sample_requests), FAKE_VOCAB), inp.sample_requests, eos
        )
        rows = {r.request_id: i for i, r in enumerate(inp.sample_requests)}
        return mr.StepHandle(inp.sample_requests, samples.to_host(), samples.token_ids, rows)

    runner.launch = fake_launch


def add_round(eng, SamplingParams, args, round_index: int) -> None:
    """Add one round's requests (prompts drawn from a seed per round)."""
    rng = random.Random(round_index)
    lo, hi = args.prompt_range
    for i in range(args.batch):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(lo, hi))]
        eng.add_request(
            f"r{round_index}-{i}",
            prompt,
            SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True),
        )


def step_round(eng) -> list[float]:
    """Step until the engine is idle; CPU seconds of each step."""
    times = []
    while eng.has_unfinished():
        t = time.process_time()
        eng.step()
        times.append(time.process_time() - t)
    return times


def profile_round(eng, SamplingParams, args, top: int) -> str:
    """One more round under cProfile (the steps only): the top functions, microseconds per
    step."""
    add_round(eng, SamplingParams, args, 10_000)
    prof = cProfile.Profile()
    prof.enable()
    n = len(step_round(eng))
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    lines = [f"cProfile over {n} steps (whole round; us per step, cProfile-inflated)"]
    for col, label in ((2, "own time"), (3, "cumulative")):
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][col])
        lines.append(f"\n| {label} us/step | calls/step | function |\n|---:|---:|---|")
        for (file, line, fn), entry in rows[:top]:
            where = f"{Path(file).parent.name}/{Path(file).name}:{line}" if line else file
            lines.append(f"| {1e6 * entry[col] / n:.1f} | {entry[1] / n:.2f} | {fn} ({where}) |")
    return "\n".join(lines)


def compare(args, argv: list[str]) -> None:
    """Alternate subprocess runs of the two trees (a loaded machine drifts: interleaving keeps
    the drift out of the difference); print each run and a table of medians over runs."""
    import re
    import subprocess

    rest, skip = [], False
    for a in argv:  # the same arguments without --tree / --compare / --repeats / --profile
        if skip:
            skip = False
        elif a in ("--tree", "--compare", "--repeats", "--profile"):
            skip = True
        elif not a.startswith(("--tree=", "--compare=", "--repeats=", "--profile=")):
            rest.append(a)
    trees = {"old": args.compare, "new": args.tree}
    found: dict[str, list[tuple[float, float]]] = {k: [] for k in trees}
    for _ in range(args.repeats):
        for name, tree in trees.items():
            out = subprocess.run(
                [sys.executable, __file__, "--tree", tree, *rest],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            print(name, out.strip())
            m = re.search(r"median ([0-9.]+) ms, p90 ([0-9.]+) ms", out)
            found[name].append((float(m.group(1)), float(m.group(2))))
    print("\n| tree | runs | median of medians ms | min median ms | median p90 ms |")
    print("|---|---:|---:|---:|---:|")
    for name, runs in found.items():
        med = statistics.median(r[0] for r in runs)
        p90 = statistics.median(r[1] for r in runs)
        low = min(r[0] for r in runs)
        print(f"| {name} ({trees[name]}) | {len(runs)} | {med:.3f} | {low:.3f} | {p90:.3f} |")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.compare:
        compare(args, argv)
        return
    build, EngineConfig, SamplingParams, ensure_ckpt, new, mr = load_tree(args.tree)
    import torch

    torch.set_num_threads(1)
    ckpt = args.ckpt or str(ensure_ckpt())
    cfg = EngineConfig(
        model=ckpt,
        num_kv_blocks=20000,
        max_num_seqs=max(args.batch, 1),
        max_model_len=4096,
        enable_prefix_caching=False,
        async_scheduling=True,
    )
    eng = build(cfg, eos_token_ids=frozenset())
    fake_device(eng, new, mr, args.sampler, graphs=not args.no_graphs)
    collections = [s["collections"] for s in gc.get_stats()]
    steady, total = [], 0
    for r in range(args.rounds):
        add_round(eng, SamplingParams, args, r)
        times = step_round(eng)
        total += len(times)
        steady += times[WARMUP_STEPS:]
    gcs = [s["collections"] - c for s, c in zip(gc.get_stats(), collections)]
    steady.sort()
    median, p90 = statistics.median(steady), steady[int(0.9 * len(steady))]
    print(
        f"{'new' if new else 'old'} layout ({args.tree}): batch {args.batch}, prompts "
        f"{args.prompt_len}, {args.max_tokens} tokens, sampler {args.sampler}, "
        f"{'eager' if args.no_graphs else 'decode graphs'}: {total} steps "
        f"({len(steady)} timed), CPU per step median {1e3 * median:.3f} ms, "
        f"p90 {1e3 * p90:.3f} ms; gc runs per generation {gcs}"
    )
    if args.profile:
        print(profile_round(eng, SamplingParams, args, args.profile))


if __name__ == "__main__":
    main()
