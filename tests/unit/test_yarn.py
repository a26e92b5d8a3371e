"""YaRN rotary scaling (Qwen3's documented way past its 32k window) against transformers, at
positions beyond the original window, in float32."""

from __future__ import annotations

import json

import pytest
import torch

from engine.core.config import EngineConfig, ModelConfig, RopeScaling
from engine.core.request import SamplingParams
from engine.core.scheduler import ScheduledBatch
from engine.worker.build import build_engine
from tests.engine_helpers import logits_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ORIGINAL = 64


@pytest.fixture(scope="module")
def yarn_checkpoint(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(7)
    cfg = Qwen3Config(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4 * ORIGINAL,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": ORIGINAL,
        },
    )
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
    path = tmp_path_factory.mktemp("qwen3-yarn")
    model.float().save_pretrained(path)
    return str(path), model.float().eval()


def test_config_reads_yarn_and_refuses_other_scalings(yarn_checkpoint, tmp_path):
    path, _ = yarn_checkpoint
    scaling = ModelConfig.from_hf(path).rope_scaling
    assert isinstance(scaling, RopeScaling) and scaling.factor == 4.0
    assert scaling.original_max_position_embeddings == ORIGINAL
    raw = json.loads(open(f"{path}/config.json").read())
    assert (raw.get("rope_scaling") or raw.get("rope_parameters"))["rope_type"] == "yarn"
    assert RopeScaling.from_hf({"rope_type": "default"}) is None
    with pytest.raises(ValueError, match="not supported"):
        RopeScaling.from_hf({"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="needs factor"):
        RopeScaling.from_hf({"rope_type": "yarn"})


def test_yarn_logits_match_transformers_beyond_the_original_window(yarn_checkpoint):
    path, hf = yarn_checkpoint
    eng = build_engine(
        EngineConfig(model=path, num_kv_blocks=64, block_size=16, max_num_batched_tokens=4096),
        eos_token_ids=frozenset(),
    )
    gen = torch.Generator().manual_seed(3)
    lengths = [250, 131, 70]  # up to ~4x the original 64-position window
    prompts = [torch.randint(0, 384, (n,), generator=gen).tolist() for n in lengths]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=1))
    batch: ScheduledBatch = eng.scheduler.schedule()
    logits = logits_for(eng, batch)
    offset = 0
    for p in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].float()
        got = logits[offset : offset + len(p)]
        offset += len(p)
        far = slice(ORIGINAL, len(p))  # positions past the original window
        rel = (got[far] - ref[far]).norm() / ref[far].norm()
        assert rel < 1e-4, f"relative error {rel:.2e} beyond position {ORIGINAL} (length {len(p)})"
        assert (got - ref).norm() / ref.norm() < 1e-4
