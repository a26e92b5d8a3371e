"""Qwen3-MoE on the GPU: the fused MoE kernel table and the engine table with dummy weights.

Usage (one H200, from the repository root; ``bash bench/run_gpu.sh moe`` installs the carried
wheels first and runs every stage)::

    python3 bench/moe.py --out /tmp/out [--stages kernels engine hf serve] [--sweep]

Stages (each prints its table as soon as it is done; JSON rows go to ``--out``):

* ``kernels``: one sparse layer of the Qwen3-30B-A3B expert shape (E=128, top-8, H=2048,
  I=768, bf16, random weights) at 1, 16, 64, 256, 1024 and 4096 tokens: router + fused MoE
  kernel (CUDA-graph replay and eager), transformers' ``Qwen3MoeSparseMoeBlock`` with its
  ``grouped_mm`` experts (graph and eager) and its ``eager`` loop, and the torch reference (one
  expert at a time, float32), on the same inputs; expert-weight TB/s and TFLOP/s against the
  measured copy and bf16 matmul ceilings; relative errors against the float32 reference with
  the kernel's own routing, and the routing's agreement with torch.topk. ``--sweep`` also times
  a few other tile configurations per token count.
* ``engine``: Qwen3-30B-A3B (48 layers, 128 experts, top-8) built with ``load_format="dummy"``
  (bf16, CUDA graphs, Triton attention and MoE, async scheduling); a GPU consistency check
  (greedy tokens of the graph path scored by the same engine's eager forward, teacher-forced),
  batch-1 time to first token after 1024 prompt tokens and decode ms/token, then offline output
  tok/s on nano-vllm's workload (256 requests, prompts and outputs uniform in [100, 1024]).
* ``hf``: transformers' ``Qwen3MoeForCausalLM`` of the same shape (random bf16, sdpa,
  ``grouped_mm`` experts, DynamicCache): prefill of 1024 tokens, decode step at batch 1 and 64.
* ``serve``: ``python -m server --load-format dummy`` on the same config and the serving
  benchmark of ``bench/serve.py`` at concurrency 1, 16, 64 (1024-token prompts, 128 outputs).

``--tiny`` swaps in small shapes (CPU: kernels under the Triton interpreter, the engine on the
torch backend) to check this script's logic without a GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

if not torch.cuda.is_available():  # --tiny on the CPU: kernels under the Triton interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parent.parent

#: Qwen3-30B-A3B's config.json (the Hub's, 2025)
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

#: the same design at toy size (``--tiny``: CPU logic check)
TINY = {
    **QWEN3_30B_A3B,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 2048,
}


def log(msg: str = "") -> None:
    print(msg, flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------- timing


def eager_ms(fns, reps: int) -> float:
    """Median ms of one call over ``reps`` rounds of the calls ``fns`` (launch overhead
    included), after one warm-up round."""
    for f in fns:
        f()
    sync()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for f in fns:
            f()
        sync()
        times.append((time.perf_counter() - t) * 1e3 / len(fns))
    return statistics.median(times)


def graph_ms(fns, reps: int = 10, rounds: int = 3) -> float | None:
    """Median ms of one call from CUDA-graph replays of ``rounds`` x the calls ``fns`` (device
    time without launch gaps); None without CUDA or when the calls cannot be captured."""
    if not torch.cuda.is_available():
        return None
    try:
        for f in fns:
            f()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for f in fns:
                f()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(rounds):
                for f in fns:
                    f()
    except Exception as exc:  # noqa: BLE001 - a peer that syncs cannot be captured
        torch.cuda.synchronize()
        log(f"  (not capturable: {type(exc).__name__}: {str(exc)[:100]})")
        return None
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / (rounds * len(fns)))
    del graph
    return statistics.median(times)


def ceilings(device) -> dict:
    """Measured copy bandwidth (TB/s, bytes read + written) and bf16 matmul TFLOP/s."""
    if device.type != "cuda":
        return {"copy_tbs": float("nan"), "mm_tflops": float("nan")}
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = graph_ms([lambda: dst.copy_(src)], reps=5, rounds=2)
    copy = 2 * src.numel() * 2 / (ms * 1e-3) / 1e12
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    ms = graph_ms([lambda: torch.matmul(a, b, out=dst[: 8192 * 8192].view(8192, 8192))], 5, 2)
    mm = 2 * 8192**3 / (ms * 1e-3) / 1e12
    return {"copy_tbs": copy, "mm_tflops": mm}


# ----------------------------------------------------------------------------- kernels

#: alternative tile configurations tried by --sweep, by the static table's BLOCK_M
SWEEP = {
    16: [
        {
            "BLOCK_M": 16,
            "gate_up": dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4),
            "down": dict(BLOCK_N=64, BLOCK_K=256, GROUP_M=1, num_warps=4, num_stages=3),
        },
        {
            "BLOCK_M": 16,
            "gate_up": dict(BLOCK_N=32, BLOCK_K=256, GROUP_M=1, num_warps=4, num_stages=3),
            "down": dict(BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=5),
        },
    ],
    32: [
        {
            "BLOCK_M": 16,
            "gate_up": dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3),
            "down": dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3),
        },
        {
            "BLOCK_M": 32,
            "gate_up": dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
            "down": dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
        },
    ],
    64: [
        {
            "BLOCK_M": 64,
            "gate_up": dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
            "down": dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
        },
        {
            "BLOCK_M": 128,
            "gate_up": dict(BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
            "down": dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
        },
    ],
    128: [
        {
            "BLOCK_M": 128,
            "gate_up": dict(BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
            "down": dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
        },
        {
            "BLOCK_M": 64,
            "gate_up": dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
            "down": dict(BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
        },
    ],
}


def hf_moe_block(shape: dict, wr, w13, w2, device):
    """transformers' Qwen3MoeSparseMoeBlock holding the given router and expert weights, and
    a function switching its experts implementation; (None, None) if it cannot be built."""
    try:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    except ImportError as exc:
        log(f"  transformers' MoE block unavailable: {exc}")
        return None, None
    cfg = Qwen3MoeConfig(
        hidden_size=shape["hidden_size"],
        moe_intermediate_size=shape["moe_intermediate_size"],
        num_experts=shape["num_experts"],
        num_experts_per_tok=shape["num_experts_per_tok"],
        norm_topk_prob=shape["norm_topk_prob"],
    )
    old = torch.get_default_dtype()
    torch.set_default_dtype(w13.dtype)
    try:
        with torch.device(device):
            block = Qwen3MoeSparseMoeBlock(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        block.gate.weight.copy_(wr)
        block.experts.gate_up_proj.copy_(w13)
        block.experts.down_proj.copy_(w2)

    def use(impl: str) -> None:
        cfg._experts_implementation = impl

    return block, use


#: input sets per timing: different routing, so a decode-sized batch reads other experts each
#: call (the engine's layers never share weights, so L2 must not hold them either)
COPIES = 4


def kernel_row(args, t, shape, weights, block, use_impl, device, g) -> dict:
    """Every implementation of one sparse layer at ``t`` tokens (see the module docstring)."""
    from kernels.fused_moe import fused_moe, fused_moe_config, moe_workspace
    from kernels.reference import fused_moe_ref, moe_experts_ref, moe_route_ref

    wr, w13, w2 = weights
    e, k = shape["num_experts"], shape["num_experts_per_tok"]
    h, i = shape["hidden_size"], shape["moe_intermediate_size"]
    dtype = w13.dtype
    xs = [torch.randn(t, h, generator=g, device=device).to(dtype) for _ in range(COPIES)]
    outs = [torch.empty_like(x) for x in xs]

    def ours_fns(workspaces):
        def one(x, out, ws):
            return fused_moe(x, torch.nn.functional.linear(x, wr), w13, w2, True, out, ws)

        return [
            lambda x=x, out=out, ws=ws: one(x, out, ws) for x, out, ws in zip(xs, outs, workspaces)
        ]

    wss = [moe_workspace(t, e, k, h, i, dtype, device) for _ in xs]
    fns = ours_fns(wss)
    for f in fns:
        f()
    sync()
    ws = wss[0]
    logits0 = torch.nn.functional.linear(xs[0], wr)
    ref_full = fused_moe_ref(xs[0], logits0, w13, w2, k, True)
    _, ref_ids = moe_route_ref(logits0, k, True)
    same = ws.topk_ids.long().sort(1).values == ref_ids.sort(1).values
    row = {
        "tokens": t,
        "config": ws.config,
        "err_fused": rel(outs[0], moe_experts_ref(xs[0], w13, w2, ws.topk_weights, ws.topk_ids)),
        "route_agree": same.float().mean().item(),
        # mean over the input copies of the experts their routing reads
        "experts_hit": statistics.mean(len(torch.unique(w.topk_ids)) for w in wss),
        "fused_graph_ms": graph_ms(fns),
        "fused_eager_ms": eager_ms(fns, reps=5),
    }
    reps = 2 if t >= 1024 else 3
    ref_fns = [
        lambda x=x: fused_moe_ref(x, torch.nn.functional.linear(x, wr), w13, w2, k, True)
        for x in xs[:2]
    ]
    row["ref_ms"] = eager_ms(ref_fns, reps=reps)
    if block is not None:
        hf_fns = [lambda x=x: block(x[None]) for x in xs]
        for impl in ("grouped_mm", "eager", "graph"):  # the capture last: a failed one may
            try:  # leave the GPU unusable
                use_impl("grouped_mm" if impl == "graph" else impl)
                if impl == "graph":
                    row["hf_grouped_mm_graph_ms"] = graph_ms(hf_fns)
                    continue
                got = block(xs[0][None])
                row[f"hf_{impl}_err"] = rel(
                    (got[0] if isinstance(got, tuple) else got)[0], ref_full
                )
                row[f"hf_{impl}_eager_ms"] = eager_ms(hf_fns, reps=reps)
            except Exception as exc:  # noqa: BLE001 - report and go on
                log(f"  transformers {impl} at T={t} failed: {type(exc).__name__}: {exc}")
    if args.sweep and device.type == "cuda":
        base_m = fused_moe_config(t, e, k, h, i, dtype, device)["BLOCK_M"]
        row["sweep"] = []
        for cfg in SWEEP.get(base_m, []):
            sw = [moe_workspace(t, e, k, h, i, dtype, device, config=cfg) for _ in xs]
            row["sweep"].append({"config": cfg, "graph_ms": graph_ms(ours_fns(sw))})
    row["best_ms"] = row["fused_graph_ms"] or row["fused_eager_ms"]
    return row


def run_kernels(args, device, out_dir: Path) -> list[dict]:
    shape = TINY if args.tiny else QWEN3_30B_A3B
    e, k = shape["num_experts"], shape["num_experts_per_tok"]
    h, i = shape["hidden_size"], shape["moe_intermediate_size"]
    dtype = torch.bfloat16
    tokens = [1, 5, 70] if args.tiny else [1, 16, 64, 256, 1024, 4096]
    g = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, generator=g, device=device) * h**-0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g, device=device) * i**-0.5).to(dtype)
    wr = (torch.randn(e, h, generator=g, device=device) * h**-0.5).to(dtype)
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    ceil = ceilings(device)
    log(
        f"ceilings: copy {ceil['copy_tbs']:.2f} TB/s (read + write), bf16 matmul 8192^3 "
        f"{ceil['mm_tflops']:.0f} TFLOP/s; one expert {expert_bytes / 2**20:.2f} MiB"
    )
    block, use_impl = hf_moe_block(shape, wr, w13, w2, device)
    rows = []
    for t in tokens:
        row = kernel_row(args, t, shape, (wr, w13, w2), block, use_impl, device, g)
        row["weight_tbs"] = row["experts_hit"] * expert_bytes / (row["best_ms"] * 1e-3) / 1e12
        row["tflops"] = 2 * t * k * 3 * h * i / (row["best_ms"] * 1e-3) / 1e12
        rows.append(row)
        log(json.dumps(row, default=str))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    (out_dir / "moe_kernels.json").write_text(json.dumps({"ceilings": ceil, "rows": rows}))
    _print_kernel_table(rows, ceil)
    return rows


def _f(x, spec=".3f"):
    return "n/a" if x is None else format(x, spec)


def _print_kernel_table(rows, ceil) -> None:
    log(
        "\n| tokens | BLOCK_M | experts read | fused graph ms | fused eager ms | HF grouped_mm "
        "graph ms | HF grouped_mm eager ms | HF eager loop ms | torch ref (fp32 loop) ms | "
        "HF grouped_mm / fused time | expert-weight TB/s (of copy) | TFLOP/s (of matmul) | "
        "rel err fused / HF vs fp32 ref | routing = topk |"
    )
    log("|" + "---|" * 14)
    for r in rows:
        # like for like: both CUDA-graph replays when transformers' block could be captured
        if r.get("hf_grouped_mm_graph_ms") and r["fused_graph_ms"]:
            fused, hf = r["fused_graph_ms"], r["hf_grouped_mm_graph_ms"]
        else:
            fused, hf = r["fused_eager_ms"], r.get("hf_grouped_mm_eager_ms")
        log(
            f"| {r['tokens']} | {r['config']['BLOCK_M']} | {r['experts_hit']:.1f} "
            f"| {_f(r['fused_graph_ms'])} | {_f(r['fused_eager_ms'])} "
            f"| {_f(r.get('hf_grouped_mm_graph_ms'))} | {_f(r.get('hf_grouped_mm_eager_ms'))} "
            f"| {_f(r.get('hf_eager_eager_ms'))} | {_f(r['ref_ms'])} "
            f"| {_f(hf / fused if hf else None, '.2f')}x "
            f"| {r['weight_tbs']:.2f} ({r['weight_tbs'] / ceil['copy_tbs']:.0%}) "
            f"| {r['tflops']:.0f} ({r['tflops'] / ceil['mm_tflops']:.0%}) "
            f"| {r['err_fused']:.1e} / {_f(r.get('hf_grouped_mm_err'), '.1e')} "
            f"| {r['route_agree']:.3f} |"
        )
        for s in r.get("sweep", []):
            c = s["config"]
            log(
                f"|   sweep | {c['BLOCK_M']} | gate_up {c['gate_up']} down {c['down']} "
                f"| {_f(s['graph_ms'])} |" + " |" * 10
            )


# ----------------------------------------------------------------------------- engine


def write_config_dir(path: Path, cfg: dict, tokenizer_from: str | None) -> Path:
    """A checkpoint directory without weights: config.json, generation_config.json and, when
    found, the tokenizer files (``tokenizer_from``, else the embedded model's)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    src = Path(tokenizer_from) if tokenizer_from else None
    if src is None or not (src / "tokenizer.json").exists():
        try:
            from engine.loader.embedded import ensure_embedded_checkpoint

            src = ensure_embedded_checkpoint()
        except Exception as exc:  # noqa: BLE001 - the engine stages need no tokenizer
            log(f"no tokenizer for {path} ({exc}); the serve stage needs one")
            return path
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, path / name)
    return path


def free_gpu() -> None:
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def batch1_latency(eng, prompt, trials: int) -> tuple[float, float]:
    """Median ms to the first token after ``prompt`` alone, and the median decode ms/token of
    the 64 tokens after it (bench/engine_check.py's measurement, device-agnostic)."""
    from engine.core.request import SamplingParams

    ttfts, tpots = [], []
    for trial in range(trials):
        eng.add_request(
            f"lat{trial}", prompt, SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True)
        )
        sync()
        t0 = time.perf_counter()
        while not any(o.new_token_ids for o in eng.step()[0]):  # async scheduling: a step later
            pass
        t1 = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        t2 = time.perf_counter()
        ttfts.append(1e3 * (t1 - t0))
        tpots.append(1e3 * (t2 - t1) / 64)
    return statistics.median(ttfts), statistics.median(tpots)


def run_engine(args, device, ckpt: Path, out_dir: Path) -> dict:
    from bench.common import nano_vllm_workload
    from engine.core.config import EngineConfig
    from engine.core.request import SamplingParams
    from engine.worker.build import build_engine
    from tests.engine_helpers import logits_for

    t0 = time.perf_counter()
    eng = build_engine(
        EngineConfig(
            model=str(ckpt),
            device=device.type,
            dtype="bfloat16" if device.type == "cuda" else "float32",
            load_format="dummy",
            max_model_len=4096,
            max_num_seqs=256,
            max_num_batched_tokens=args.offline_budget,
            prefill_graph_max_tokens=args.prefill_graph_max_tokens,
            enable_prefix_caching=False,
        ),
        eos_token_ids=frozenset(),
    )
    res = {"build_s": time.perf_counter() - t0}
    runner = eng.executor
    res["weights"] = runner.model.weight_summary()
    res["kv_blocks"] = eng.cache_info.num_kv_blocks
    log(f"engine built in {res['build_s']:.1f} s: {res['weights']}; {res['kv_blocks']} KV blocks")

    # consistency on the GPU: greedy tokens of the production path (prefill and decode CUDA
    # graphs, fused MoE kernel) scored by the same engine's eager forward, teacher-forced
    gen = torch.Generator().manual_seed(0)
    vocab = runner.model_config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (7, 100, 300, 33)]
    outs = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    top, near, total = 0, 0, 0
    for p, o in zip(prompts, outs):
        req = eng.add_request(f"tf{len(p)}", p + o[:-1], SamplingParams(max_tokens=1))
        batch = eng.scheduler.schedule()
        rows = logits_for(eng, batch)[len(p) - 1 :]
        eng.abort(req.request_id)
        eng.step()
        for row, tok in zip(rows, o):
            total += 1
            top += int(row.argmax()) == tok
            near += bool(row[tok] >= row.max() - 0.05)
    res["greedy_is_eager_argmax"] = top / total
    res["greedy_within_0.05_of_eager_max"] = near / total
    log(
        f"greedy 4x16 tokens (graphs) vs the engine's eager forward: argmax {top / total:.3f}, "
        f"within 0.05 of the top logit {near / total:.3f}"
    )

    prompt = torch.randint(0, vocab, (1024,), generator=gen).tolist()
    res["ttft_1024_ms"], res["tpot_ms"] = batch1_latency(eng, prompt, trials=3)
    log(f"batch 1: TTFT after 1024 tokens {res['ttft_1024_ms']:.2f} ms, TPOT {res['tpot_ms']:.3f}")

    n = 16 if args.tiny else 256
    prompts, out_lens = nano_vllm_workload(n, max_input_len=1024, max_output_len=1024)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in out_lens]
    sync()
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params)
    sync()
    sec = time.perf_counter() - t0
    total = sum(len(o) for o in outs)
    assert total == sum(out_lens)
    res.update(
        offline_requests=n,
        offline_prompt_tokens=sum(map(len, prompts)),
        offline_output_tokens=total,
        offline_s=sec,
        offline_tok_s=total / sec,
        preemptions=eng.scheduler.num_preemptions,
    )
    log(
        f"offline nano-vllm workload: {n} requests, {res['offline_prompt_tokens']} prompt + "
        f"{total} output tokens in {sec:.2f} s = {total / sec:.0f} output tok/s "
        f"({res['preemptions']} preemptions)"
    )
    (out_dir / "moe_engine.json").write_text(json.dumps(res))
    del eng, runner
    free_gpu()
    return res


def run_hf(args, device, cfg: dict, out_dir: Path) -> dict:
    """transformers' Qwen3MoeForCausalLM, random bf16, grouped_mm experts: prefill of 1024
    tokens, decode ms/step at batch 1 and 64 (DynamicCache, eager)."""
    from transformers import DynamicCache, Qwen3MoeConfig, Qwen3MoeForCausalLM

    hf_cfg = Qwen3MoeConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3MoeForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(old)
    impl = "grouped_mm"
    try:
        model.set_experts_implementation(impl)
    except Exception as exc:  # noqa: BLE001 - older API: the config attribute
        log(f"set_experts_implementation failed ({exc}); setting the config attribute")
        model.config._experts_implementation = impl
    res = {"build_s": time.perf_counter() - t0, "experts": model.config._experts_implementation}
    log(f"transformers model built in {res['build_s']:.1f} s, experts {res['experts']}")
    vocab = cfg["vocab_size"]
    gen = torch.Generator().manual_seed(1)

    @torch.no_grad()
    def prefill(ids, model=model):
        cache = DynamicCache()
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return cache, out.logits[:, -1].argmax(-1, keepdim=True)

    @torch.no_grad()
    def decode_ms(batch, ctx, steps, model=model):
        ids = torch.randint(0, vocab, (batch, ctx), generator=gen).to(device)
        cache, nxt = prefill(ids)
        for _ in range(2):  # warm-up steps
            nxt = model(nxt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        sync()
        t = time.perf_counter()
        for _ in range(steps):
            nxt = model(nxt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        sync()
        return (time.perf_counter() - t) * 1e3 / steps

    ids = torch.randint(0, vocab, (1, 1024), generator=gen).to(device)
    prefill(ids)
    ttfts = []
    for _ in range(3):
        sync()
        t = time.perf_counter()
        prefill(ids)
        sync()
        ttfts.append((time.perf_counter() - t) * 1e3)
    res["ttft_1024_ms"] = statistics.median(ttfts)
    steps = 4 if args.tiny else 16
    res["decode_b1_ms"] = decode_ms(1, 64, steps)
    res["decode_b64_ms"] = decode_ms(64, 128, steps // 2)
    res["b64_tok_s"] = 64 / (res["decode_b64_ms"] * 1e-3)
    log(
        f"transformers: prefill 1024 tokens {res['ttft_1024_ms']:.1f} ms; decode step "
        f"{res['decode_b1_ms']:.1f} ms at batch 1 ({1e3 / res['decode_b1_ms']:.0f} tok/s), "
        f"{res['decode_b64_ms']:.1f} ms at batch 64 ({res['b64_tok_s']:.0f} tok/s)"
    )
    (out_dir / "moe_hf.json").write_text(json.dumps(res))
    del model
    free_gpu()
    return res


def run_serve(args, device, ckpt: Path, out_dir: Path) -> list[dict]:
    from bench.serve import bench_server, make_prompts, print_table

    if not (ckpt / "tokenizer.json").exists():
        log("serve: no tokenizer in the config directory, skipped")
        return []
    levels = [1, 2] if args.tiny else [1, 16, 64]
    ns = argparse.Namespace(
        concurrency=levels,
        peer_concurrency=None,
        min_requests=4 if args.tiny else 8,
        requests_per_concurrency=2,
        peer_time_cap=60,
        max_tokens=16 if args.tiny else 128,
        py_spy_level=None,
        client_procs=8,
        out=str(out_dir),
    )
    n = max(ns.min_requests, max(levels) * ns.requests_per_concurrency)
    prompts = make_prompts(str(ckpt), n, 64 if args.tiny else 1024)
    cmd = [sys.executable, "-m", "server", "--model", str(ckpt), "--load-format", "dummy"]
    cmd += ["--port", "8100", "--max-model-len", "4096", "--served-model-name", "bench"]
    cmd += ["--log-level", "warning"]
    if device.type == "cuda":
        cmd += ["--dtype", "bfloat16"]
    t0 = time.perf_counter()
    rows = bench_server("qwen-serve", cmd, 8100, "bench", ns, prompts, f"{out_dir}/moe_serve.log")
    log(f"serve stage (server start-up included): {time.perf_counter() - t0:.1f} s")
    print_table(rows)
    (out_dir / "moe_serve.json").write_text(json.dumps(rows))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", nargs="+", default=["kernels", "engine", "hf", "serve"])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--ckpt", default="/tmp/qwen3-30b-a3b-dummy", help="config directory")
    ap.add_argument("--tokenizer-from", default=str(REPO / ".benchassets" / "tokenizer"))
    ap.add_argument("--sweep", action="store_true", help="time other tile configs too")
    ap.add_argument("--offline-budget", type=int, default=8192, help="token budget, offline")
    ap.add_argument("--prefill-graph-max-tokens", type=int, default=2048)
    ap.add_argument("--tiny", action="store_true", help="toy shapes (CPU logic check)")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        log(f"GPU: {torch.cuda.get_device_name()}")
    import transformers
    import triton

    versions = (torch.__version__, triton.__version__, transformers.__version__)
    log("torch {}, triton {}, transformers {}".format(*versions))
    cfg = TINY if args.tiny else QWEN3_30B_A3B
    ckpt = write_config_dir(Path(args.ckpt), cfg, args.tokenizer_from)
    start = time.perf_counter()
    summary = {}
    for stage in args.stages:
        t = time.perf_counter()
        log(f"\n=== {stage} ===")
        try:
            if stage == "kernels":
                with torch.no_grad():
                    run_kernels(args, device, out_dir)
            elif stage == "engine":
                summary["ours"] = run_engine(args, device, ckpt, out_dir)
            elif stage == "hf":
                summary["hf"] = run_hf(args, device, cfg, out_dir)
            elif stage == "serve":
                summary["serve"] = run_serve(args, device, ckpt, out_dir)
            else:
                ap.error(f"unknown stage {stage}")
        except Exception:  # noqa: BLE001 - report, free the GPU, run the next stage
            import traceback

            traceback.print_exc()
            free_gpu()
        log(f"=== {stage}: {time.perf_counter() - t:.1f} s ===")
    _print_engine_table(summary)
    log(f"\nall stages: {time.perf_counter() - start:.1f} s")
    return 0


def _print_engine_table(s: dict) -> None:
    ours, hf = s.get("ours"), s.get("hf")
    if not ours and not hf:
        return
    log("\n| metric | qwen-serve | transformers (grouped_mm, DynamicCache) | ratio |")
    log("|---|---|---|---|")

    def line(name, a, b, spec, better_low=True):
        ratio = (b / a if better_low else a / b) if a and b else None
        log(f"| {name} | {_f(a, spec)} | {_f(b, spec)} | {_f(ratio, '.1f')}x |")

    line("batch-1 decode, ms/token", ours and ours["tpot_ms"], hf and hf["decode_b1_ms"], ".2f")
    line(
        "first token after 1024 prompt tokens, ms",
        ours and ours["ttft_1024_ms"],
        hf and hf["ttft_1024_ms"],
        ".1f",
    )
    if ours:
        peer = f"batch-64 decode: {hf['b64_tok_s']:.0f}" if hf else ""
        log(
            f"| offline nano-vllm workload, output tok/s | {ours['offline_tok_s']:.0f} | {peer} | |"
        )
    for r in s.get("serve") or []:
        log(
            f"| serve c={r['concurrency']}: out tok/s, TTFT/TPOT median ms | {r['out_tok_s']:.0f}, "
            f"{r['ttft_median']:.1f}/{r['tpot_median']:.2f} | | |"
        )


if __name__ == "__main__":
    sys.exit(main())
