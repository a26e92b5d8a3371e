"""Helpers that reach into a live engine for tests and GPU checks (not product code)."""

from __future__ import annotations

import torch

from engine.core.llm_engine import LLMEngine
from engine.core.scheduler import ScheduledBatch
from engine.worker.block_table import PersistentBlockTables
from engine.worker.step_inputs import prepare_inputs


@torch.inference_mode()
def logits_for(engine: LLMEngine, batch: ScheduledBatch) -> torch.Tensor:
    """Float32 logits of every scheduled token ``[T, vocab]`` of a batch run eagerly through the
    engine's model runner (its KV cache is written; nothing is sampled). Tests compare these
    with transformers' logits."""
    runner = engine.executor
    inp = prepare_inputs(batch, runner.config.block_size, runner.block_tables)
    runner.staging.next_step()
    return runner.model.compute_logits(runner.forward(inp.to_device(runner.staging))).float()


def mirror_blocks(mirror: PersistentBlockTables, request_id: str) -> list[int]:
    """The block ids in a request's row of the worker's block-table mirror ([] if it has none)."""
    row = mirror._rows.get(request_id)
    return [] if row is None else mirror.table[row, : mirror._lengths[request_id]].tolist()
