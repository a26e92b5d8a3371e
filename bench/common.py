"""Shared pieces of the GPU benchmarks: the random Qwen3-0.6B checkpoint and the nano-vllm
workload."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

QWEN3_06B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


def random_qwen3_checkpoint(
    path: str | Path,
    dtype: str = "bfloat16",
    seed: int = 0,
    tokenizer_from: str | Path | None = None,
) -> Path:
    """Write a Qwen3-0.6B-architecture checkpoint with random weights (transformers' init), once.

    ``tokenizer_from``: a directory whose tokenizer.json / tokenizer_config.json are copied in
    (the serving benchmarks need a tokenizer; the embedded model's is the real Qwen3 one).
    """
    import shutil

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = Path(path)
    if tokenizer_from is not None:
        path.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(tokenizer_from) / name, path / name)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = Qwen3Config(**QWEN3_06B, torch_dtype=dtype, eos_token_id=151645, bos_token_id=151643)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3ForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    del model
    return path


def nano_vllm_workload(
    num_seqs: int = 256, max_input_len: int = 1024, max_output_len: int = 1024, seed: int = 0
):
    """nano-vllm's bench.py workload: random prompt ids in [0, 10000], prompt and output lengths
    uniform in [100, max], seed 0. Returns (prompts, output_lengths)."""
    random.seed(seed)
    prompts = [
        [random.randint(0, 10000) for _ in range(random.randint(100, max_input_len))]
        for _ in range(num_seqs)
    ]
    outputs = [random.randint(100, max_output_len) for _ in range(num_seqs)]
    return prompts, outputs


class Timer:
    def __enter__(self):
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.t0
