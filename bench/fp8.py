"""Block FP8 on the GPU: the FP8 linear kernels against bf16 and ``torch._scaled_mm``, and the
engine with Qwen3-8B-shape dummy weights in FP8 against bf16, in one run.

Usage (one H200, from the repository root, after installing the carried wheels as
``bench/run_gpu.sh`` does)::

    python3 bench/fp8.py --out /tmp/out [--stages kernels engine serve] [--sweep]

Stages (each prints its table when done; JSON rows go to ``--out``):

* ``kernels``: Qwen3-8B's four linear shapes (qkv 4096->6144, o 4096->4096, gate_up
  4096->24576, down 12288->4096) at M = 1, 16, 64, 256, 4096: ``kernels.fp8_gemm.fp8_linear``
  (block-FP8 weights, activations quantized per token in groups of 128; its tiles from the
  device's table ``kernels/configs/fp8_gemm_<device>.json`` where ``bench/fp8_sweep.py
  --write-table`` wrote one, else the built-in ones), bf16 ``torch.matmul``,
  and ``torch._scaled_mm`` with row-wise scales (the fastest FP8 GEMM torch ships; a different
  scaling, so only its time is compared), all CUDA-graph timed, below M = 1024 over weight
  copies of 128 MB in all (no weight still in L2, as in a model); TFLOP/s, weight TB/s, and the
  kernel's relative error against the float32 product of the dequantized operands
  (``kernels.reference.fp8_group_quant_ref`` for the activations). The summed time of the four
  shapes at M = 1 and 16 against bf16's is the issue's small-M target. ``--sweep`` also times
  other split-K values of the small-M kernel.
* ``engine``: Qwen3-8B shape (36 layers, hidden 4096, ``load_format="dummy"``), bf16 and then
  ``quantization="fp8"`` (weights quantized at load): batch-1 TTFT after 1024 tokens and TPOT,
  offline output tok/s on nano-vllm's workload (256 requests).
* ``serve``: ``python -m server --load-format dummy`` with and without ``--quantization fp8``
  and ``bench/serve.py``'s level at concurrency 64 (1024-token prompts, 128 outputs).

``--tiny`` swaps in small shapes (CPU: kernels under the Triton interpreter, the engine on the
torch backend) to check this script's logic without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.moe import batch1_latency, free_gpu, graph_ms, log, rel, sync, write_config_dir  # noqa: E402

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
}
TINY = {**QWEN3_8B, "hidden_size": 256, "intermediate_size": 384, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 151936,
        "max_position_embeddings": 4096}  # fmt: skip
#: (name, N, K) of Qwen3-8B's linear layers
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)]
TINY_SHAPES = [("qkv", 256, 128)]


#: weight bytes a timed graph cycles through below M = 1024 (the H200's L2 is 50 MB): each call
#: reads its weights from HBM, as each layer of a model reads its own
COPY_BYTES = 128 << 20


def _time(fn, device, weights=None) -> float | None:
    """ms of one call: CUDA-graph replay on the GPU (``fn(w)`` for each of ``weights``, the
    copies of one weight, when given), one timed call on the CPU."""
    fns = [fn] if weights is None else [partial(fn, w) for w in weights]
    if device.type == "cuda":
        return graph_ms(fns)
    t = time.perf_counter()
    fns[0]()
    return 1e3 * (time.perf_counter() - t)


def _copies(t: torch.Tensor, m: int) -> list[torch.Tensor]:
    """``t`` and clones, ``COPY_BYTES`` in all (one tensor from M = 1024: compute bound)."""
    count = 1 if m >= 1024 else -(-COPY_BYTES // (t.numel() * t.element_size()))
    return [t] + [t.clone() for _ in range(count - 1)]


def kernel_rows(args, device) -> list[dict]:
    from engine.layers.quantization.fp8 import quantize_fp8_blocks
    from kernels.fp8_gemm import Fp8Config, fp8_config, fp8_linear
    from kernels.reference import fp8_group_quant_ref

    g = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    ms = (1, 33) if args.tiny else (1, 16, 64, 256, 4096)
    for name, n, k in TINY_SHAPES if args.tiny else SHAPES:
        w = (torch.randn(n, k, generator=g) * 0.02).to(device, torch.bfloat16)
        wq, ws = quantize_fp8_blocks(w)
        w_deq = wq.float() * ws.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        wt = w.t().contiguous().t()  # [N, K] row-major, as F.linear reads it
        w_row = w.float().abs().amax(dim=1).clamp_min(1e-12) / 448.0  # row-wise scales
        w8_row = (w.float() / w_row[:, None]).to(torch.float8_e4m3fn)
        for m in ms:
            x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
            xq, xs = fp8_group_quant_ref(x.float())
            x_deq = xq.float() * xs.repeat_interleave(128, 1)[:, :k]
            ref = x_deq @ w_deq.t()
            got = fp8_linear(x, wq, ws)
            row = {"shape": name, "n": n, "k": k, "m": m, "err": rel(got, ref)}
            wqs = [(w8, ws.clone()) for w8 in _copies(wq, m)]
            row["fp8_ms"] = _time(lambda p, x=x: fp8_linear(x, p[0], p[1]), device, wqs)
            row["bf16_ms"] = _time(partial(torch.nn.functional.linear, x), device, _copies(wt, m))
            row["scaled_mm_ms"] = None
            if device.type == "cuda":
                mp = max(16, -(-m // 16) * 16)  # _scaled_mm wants M a multiple of 16
                xp = torch.zeros(mp, k, device=device, dtype=torch.bfloat16)
                xp[:m] = x
                x_row = xp.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 448.0
                x8 = (xp.float() / x_row).to(torch.float8_e4m3fn)
                try:

                    def mm(w8, x8=x8, x_row=x_row, w_row=w_row):
                        return torch._scaled_mm(
                            x8, w8.t(), scale_a=x_row, scale_b=w_row[None, :].contiguous(),
                            out_dtype=torch.bfloat16,
                        )  # fmt: skip

                    row["scaled_mm_ms"] = _time(mm, device, _copies(w8_row, m))
                except RuntimeError as exc:
                    log(f"  _scaled_mm {name} M={m}: {str(exc)[:100]}")
            t = row["fp8_ms"]
            row["fp8_tflops"] = 2 * m * n * k / (t * 1e-3) / 1e12 if t else None
            row["fp8_weight_tbs"] = n * k / (t * 1e-3) / 1e12 if t else None
            if args.sweep and device.type == "cuda" and m <= 16:
                base = fp8_config(m, n, k)
                row["sweep"] = {}
                for split in (1, 2, 3, 4, 6, 8, 12):
                    cfg = Fp8Config("gemv", base.block_m, base.block_n, 4, 4, split_k=split)
                    row["sweep"][split] = _time(partial(fp8_linear, x, wq, ws, config=cfg), device)
            rows.append(row)
    return rows


def _f(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def print_kernel_table(rows) -> None:
    log("\n| shape | M | FP8 kernel ms | bf16 matmul ms | _scaled_mm (row-wise) ms | FP8 / bf16 "
        "time | FP8 TFLOP/s | FP8 weight TB/s | rel err vs dequantized fp32 |")  # fmt: skip
    log("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["fp8_ms"] / r["bf16_ms"] if r["fp8_ms"] and r["bf16_ms"] else None
        log(
            f"| {r['shape']} {r['k']}->{r['n']} | {r['m']} | {_f(r['fp8_ms'])} | "
            f"{_f(r['bf16_ms'])} | {_f(r['scaled_mm_ms'])} | {_f(ratio, '.2f')} | "
            f"{_f(r['fp8_tflops'], '.0f')} | {_f(r['fp8_weight_tbs'], '.2f')} | {r['err']:.1e} |"
        )
        if r.get("sweep"):
            log(f"|  split-K sweep (ms) | | {r['sweep']} | | | | | | |")
    for m in (1, 16):
        sel = [r for r in rows if r["m"] == m and r["fp8_ms"] and r["bf16_ms"]]
        if sel:
            f8, b16 = sum(r["fp8_ms"] for r in sel), sum(r["bf16_ms"] for r in sel)
            log(f"M={m}, shapes summed: FP8 {f8:.3f} ms, bf16 {b16:.3f} ms, {f8 / b16:.2f}x")


def engine_row(args, device, ckpt: Path, quantization: str | None) -> dict:
    from bench.common import nano_vllm_workload
    from engine.core.config import EngineConfig
    from engine.core.request import SamplingParams
    from engine.worker.build import build_engine

    t0 = time.perf_counter()
    eng = build_engine(
        EngineConfig(
            model=str(ckpt),
            device=device.type,
            dtype="bfloat16" if device.type == "cuda" else "float32",
            load_format="dummy",
            quantization=quantization,
            max_model_len=4096,
            max_num_seqs=256,
            enable_prefix_caching=False,
        ),
        eos_token_ids=frozenset(),
    )
    res = {"quantization": quantization or "bf16", "build_s": time.perf_counter() - t0}
    res["weights"] = eng.executor.model.weight_summary()
    log(f"{res['quantization']}: built in {res['build_s']:.1f} s: {res['weights']}")
    vocab = eng.executor.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (64 if args.tiny else 1024,), generator=gen).tolist()
    res["ttft_1024_ms"], res["tpot_ms"] = batch1_latency(eng, prompt, trials=3)
    if args.offline_seqs == 0:  # batch-1 latency only
        res["offline_tok_s"] = float("nan")
        del eng
        free_gpu()
        return res
    n = 4 if args.tiny else args.offline_seqs
    lens = 128 if args.tiny else 1024
    prompts, out_lens = nano_vllm_workload(n, max_input_len=lens, max_output_len=lens)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in out_lens]
    sync()
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params)
    sync()
    sec = time.perf_counter() - t0
    res["offline_tok_s"] = sum(len(o) for o in outs) / sec
    log(
        f"{res['quantization']}: TTFT 1024 {res['ttft_1024_ms']:.2f} ms, TPOT "
        f"{res['tpot_ms']:.3f} ms, offline {res['offline_tok_s']:.0f} output tok/s"
    )
    del eng
    free_gpu()
    return res


def serve_rows(args, device, ckpt: Path, out_dir: Path) -> list[dict]:
    from bench.serve import bench_server, make_prompts

    conc = [4] if args.tiny else [64]
    ns = argparse.Namespace(
        concurrency=conc, peer_concurrency=None, min_requests=8, requests_per_concurrency=2,
        peer_time_cap=60, max_tokens=16 if args.tiny else 128, py_spy_level=None,
        client_procs=8, out=str(out_dir),
    )  # fmt: skip
    prompts = make_prompts(str(ckpt), max(8, 2 * conc[0]), 64 if args.tiny else 1024)
    rows = []
    for quant in (None, "fp8"):
        cmd = [sys.executable, "-m", "server", "--model", str(ckpt), "--load-format", "dummy",
               "--port", "8101", "--max-model-len", "4096", "--served-model-name", "bench",
               "--log-level", "warning", "--device", device.type]  # fmt: skip
        if device.type == "cuda":
            cmd += ["--dtype", "bfloat16"]
        if quant:
            cmd += ["--quantization", quant]
        name = quant or "bf16"
        for r in bench_server(name, cmd, 8101, "bench", ns, prompts, f"{out_dir}/fp8_{name}.log"):
            rows.append({"quantization": name, **r})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp")
    ap.add_argument("--stages", nargs="+", default=["kernels", "engine", "serve"])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument(
        "--offline-seqs",
        type=int,
        default=256,
        help="requests of the engine stage's offline run (0: batch-1 latency only)",
    )
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--tokenizer-from", default=str(REPO / ".benchassets/tokenizer"))
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    summary = {}
    if "kernels" in args.stages:
        rows = kernel_rows(args, device)
        (out_dir / "fp8_kernels.json").write_text(json.dumps(rows))
        print_kernel_table(rows)
    ckpt = write_config_dir(out_dir / "qwen3-8b-shape", TINY if args.tiny else QWEN3_8B,
                            args.tokenizer_from)  # fmt: skip
    if "engine" in args.stages:
        summary["engine"] = [engine_row(args, device, ckpt, q) for q in (None, "fp8")]
        (out_dir / "fp8_engine.json").write_text(json.dumps(summary["engine"]))
        b, f = summary["engine"]
        log("\n| metric | bf16 | FP8 | FP8 / bf16 |\n|---|---|---|---|")
        for key in ("tpot_ms", "ttft_1024_ms", "offline_tok_s"):
            log(f"| {key} | {b[key]:.3f} | {f[key]:.3f} | {f[key] / b[key]:.2f} |")
    if "serve" in args.stages:
        rows = serve_rows(args, device, ckpt, out_dir)
        (out_dir / "fp8_serve.json").write_text(json.dumps(rows))
        log("\n| weights | conc | done | out tok/s | TTFT med ms | TPOT med ms | ITL p99 ms |")
        log("|---|---|---|---|---|---|---|")
        for r in rows:
            log(
                f"| {r['quantization']} | {r['concurrency']} | {r['completed']} | "
                f"{r['out_tok_s']:.0f} | {r['ttft_median']:.1f} | {r['tpot_median']:.2f} | "
                f"{r['itl_p99']:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
