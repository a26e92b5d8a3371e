"""Tensor parallelism on the CPU (gloo): TP=2 against TP=1 on tiny random Qwen3, Qwen2 and
Qwen3-MoE checkpoints written by transformers (float32).

Each TP=2 engine runs in a process of its own (``tests.tp_scenario``): it becomes rank 0 and
spawns rank 1, so the test process never joins a process group. The same scenario runs in the
test process for TP=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.core.config import EngineConfig, ModelConfig
from tests import tp_scenario
from tests.conftest import hf_greedy

ROOT = Path(__file__).resolve().parents[2]
#: seconds a TP=2 scenario may take on the shared 2-core machine
TIMEOUT_S = 180


def run_tp(path: str, tp: int, tmp_path, overrides: dict | None = None) -> dict:
    """The scenario in a fresh process with ``tp`` ranks; its saved result."""
    out = tmp_path / f"tp{tp}.pt"
    cmd = [sys.executable, "-m", "tests.tp_scenario", path, str(tp), str(out)]
    if overrides:
        cmd.append(json.dumps(overrides))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


def run_tp1(path: str) -> dict:
    vocab = json.load(open(f"{path}/config.json"))["vocab_size"]
    return tp_scenario.run(tp_scenario.engine_config(path, 1), vocab)


def compare(tp1: dict, tp2: dict) -> float:
    """Assert identical greedy ids and logits within 1e-5 relative; returns the worst error."""
    assert tp2["ids"] == tp1["ids"]
    assert tp2["ids"]["sync"] == tp2["ids"]["async"]
    assert tp1["preemptions"] >= 1 and tp2["preemptions"] == tp1["preemptions"]
    assert tp2["logits"].keys() == tp1["logits"].keys()
    worst = 0.0
    for key, ref in tp1["logits"].items():
        got = tp2["logits"][key]
        assert got.shape == ref.shape, key
        err = float((got - ref).norm() / ref.norm())
        worst = max(worst, err)
        assert err < 1e-5, (key, err)
    # penalties (deferred sampling), prompt logprobs: same ids, same prompt scores
    for (ids1, plp1), (ids2, plp2) in zip(tp1["extras"], tp2["extras"]):
        assert ids2 == ids1
        assert len(plp2) == len(plp1) > 0
        for (lp1, rank1, alts1), (lp2, rank2, alts2) in zip(plp1, plp2):
            assert abs(lp2 - lp1) < 1e-4 and rank2 == rank1
            assert [t for t, _ in alts2] == [t for t, _ in alts1]
    return worst


def test_dense_tp2_equals_tp1(tiny_checkpoint, tmp_path, one_torch_thread):
    """Qwen3 (tied embeddings) and Qwen2 (qkv bias, untied): logits and greedy ids of 8
    concurrent prompts with preemption, sync and async scheduling, equal to TP=1; the ids also
    equal transformers' generate of each prompt alone."""
    path, hf = tiny_checkpoint
    tp1 = run_tp1(path)
    tp2 = run_tp(path, 2, tmp_path)
    compare(tp1, tp2)
    for prompt, ids in zip(tp_scenario.prompts(384), tp2["ids"]["sync"]):
        assert ids == hf_greedy(hf, prompt, tp_scenario.NUM_TOKENS)
    layout = tp2["layout"]
    assert [r["rank"] for r in layout] == [0, 1]
    assert all(r["kv_heads"] == 1 for r in layout)  # 2 KV heads split over 2 ranks
    whole = tp1["layout"][0]
    for r in layout:  # each rank holds about half: its shards and the replicated norms
        assert r["weight_bytes"] < 0.6 * whole["weight_bytes"]
        assert r["kv_cache_bytes"] == whole["kv_cache_bytes"] // 2


def test_gguf_tp2_equals_tp1(tiny_checkpoint, tmp_path, monkeypatch, one_torch_thread):
    """A GGUF file (Q8_0; each tensor dequantized whole to float32 at load, no lazy reads) split
    over 2 ranks by the same weight loaders gives TP=1's logits and greedy ids on that file."""
    from engine.loader.gguf_loader import prepare_gguf_model_dir
    from tests.gguf_helpers import write_tiny_gguf

    monkeypatch.setenv("QWEN_SERVE_CACHE", str(tmp_path / "cache"))  # the TP=2 process too
    path, model = tiny_checkpoint
    arch = json.load(open(f"{path}/config.json"))["model_type"]
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", model, arch, "Q8_0")
    model_dir = str(prepare_gguf_model_dir(gguf_path))
    compare(run_tp1(model_dir), run_tp(model_dir, 2, tmp_path))


def test_dummy_weights_tp2_equal_tp1(tiny_moe_checkpoint, tmp_path, one_torch_thread):
    """load_format="dummy" draws each full checkpoint tensor (q/k/v, each expert's gate/up)
    from its own seed and keeps the rank's slice: TP=2 holds the slices of TP=1's random model
    (logits within 1e-5; the ids of such a flat random model are not compared)."""
    path, _ = tiny_moe_checkpoint
    vocab = json.load(open(f"{path}/config.json"))["vocab_size"]
    tp1 = tp_scenario.run(tp_scenario.engine_config(path, 1, load_format="dummy", seed=5), vocab)
    tp2 = run_tp(path, 2, tmp_path, {"load_format": "dummy", "seed": 5})
    assert tp1["logits"] and tp2["logits"].keys() == tp1["logits"].keys()
    for key, ref in tp1["logits"].items():
        err = float((tp2["logits"][key] - ref).norm() / ref.norm())
        assert err < 1e-5, (key, err)


def test_moe_tp2_equals_tp1(tiny_moe_checkpoint, tmp_path, one_torch_thread):
    """Qwen3-MoE: experts split tensor-parallel (each rank holds 32 of every expert's 64
    features); a dense layer (mlp_only_layers) in between."""
    path, hf = tiny_moe_checkpoint
    tp2 = run_tp(path, 2, tmp_path)
    compare(run_tp1(path), tp2)
    for prompt, ids in zip(tp_scenario.prompts(384), tp2["ids"]["sync"]):
        assert ids == hf_greedy(hf, prompt, tp_scenario.NUM_TOKENS)


def _config_with(path: str, tmp_path, **fields) -> str:
    cfg = json.load(open(f"{path}/config.json"))
    cfg.update(fields)
    out = tmp_path / "bad"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


@pytest.mark.parametrize(
    ("fields", "dimension"),
    [
        ({"num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": 32}, "num_key_value"),
        ({"num_attention_heads": 5}, "num_attention_heads = 5"),
        ({"moe_intermediate_size": 33}, "moe_intermediate_size"),
        ({"intermediate_size": 161}, "intermediate_size = 161"),
        ({"vocab_size": 385}, "vocab_size = 385"),
    ],
)
def test_indivisible_shapes_are_refused(tiny_moe_checkpoint, tmp_path, fields, dimension):
    """Refused by the config check every rank runs before the rendezvous."""
    path = _config_with(tiny_moe_checkpoint[0], tmp_path, **fields)
    with pytest.raises(ValueError, match=dimension):
        ModelConfig.from_hf(path).check_tensor_parallel(2)


def test_fp8_expert_blocks_are_refused(tiny_moe_checkpoint, tmp_path):
    path = _config_with(
        tiny_moe_checkpoint[0],
        tmp_path,
        moe_intermediate_size=768,
        quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]},
    )
    with pytest.raises(ValueError, match="tensor_parallel_size 4 with fp8 quantization") as err:
        ModelConfig.from_hf(path).check_tensor_parallel(4)
    assert "quantization block 128" in str(err.value)  # 768 / 4 = 192 also cuts the blocks


def _spawned_children() -> set[int]:
    """Pids of this process's live children (a refused engine must leave none behind)."""
    import multiprocessing

    return {p.pid for p in multiprocessing.active_children()}


@pytest.mark.parametrize("source", ["checkpoint", "flag"])
def test_quantization_with_tp_is_refused_at_start_up(tiny_moe_checkpoint, tmp_path, source):
    """TP > 1 with any quantization (the checkpoint's block FP8 or --quantization fp8) is a
    ValueError naming both before any rank starts: the FP8 scales are not split per rank."""
    from engine.worker.build import build_engine

    if source == "checkpoint":
        qc = {"quant_method": "fp8", "weight_block_size": [128, 128]}
        path = _config_with(tiny_moe_checkpoint[0], tmp_path, quantization_config=qc)
        config = EngineConfig(model=path, tensor_parallel_size=2, load_format="dummy")
        where = "the checkpoint's quantization_config"
    else:
        config = EngineConfig(
            model=tiny_moe_checkpoint[0], tensor_parallel_size=2, quantization="fp8"
        )
        where = "--quantization"
    before = _spawned_children()
    with pytest.raises(ValueError, match="tensor_parallel_size 2 with fp8 quantization") as err:
        build_engine(config)
    assert where in str(err.value)
    assert _spawned_children() == before


def test_build_engine_refuses_before_spawning_ranks(tiny_moe_checkpoint, tmp_path):
    """build_engine with TP=2 on an indivisible checkpoint raises at start-up, naming the
    dimension, and starts no process."""
    from engine.worker.build import build_engine

    path = _config_with(tiny_moe_checkpoint[0], tmp_path, num_key_value_heads=3)
    with pytest.raises(ValueError, match="num_key_value_heads = 3"):
        build_engine(EngineConfig(model=path, tensor_parallel_size=2))


def test_moe_tp4_replicates_kv_heads(tiny_moe_checkpoint, tmp_path, one_torch_thread):
    """TP=4 on 2 KV heads: each KV head replicated on 2 ranks (1 query head, 16 features of
    every expert, 96 vocab rows per rank); equal to TP=1."""
    path, _ = tiny_moe_checkpoint
    tp4 = run_tp(path, 4, tmp_path)
    compare(run_tp1(path), tp4)
    assert [r["kv_heads"] for r in tp4["layout"]] == [1, 1, 1, 1]


def test_server_exit_without_shutdown_does_not_hang(tiny_moe_checkpoint):
    """A TP engine-core process is not daemonic (it spawns its ranks): a process that started
    one and exits without shutting it down must still exit (multiprocessing would join it
    forever), and take the ranks with it."""
    code = (
        "from engine.core.config import EngineConfig\n"
        "from engine.frontend.process_core import ProcessCore\n"
        f"cfg = EngineConfig(model={tiny_moe_checkpoint[0]!r}, device='cpu',"
        " tensor_parallel_size=2, num_kv_blocks=16)\n"
        "core = ProcessCore(cfg, frozenset())\n"
        "print('pid', core._proc.pid, flush=True)\n"
        "raise SystemExit(0)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=90
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    pid = int(proc.stdout.split()[1])
    stat = Path(f"/proc/{pid}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
