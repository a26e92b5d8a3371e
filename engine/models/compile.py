"""Whole-model ``torch.compile`` (``compile_mode="model"``): one Dynamo frame compiled by Inductor
with attention as the opaque custom op ``qwen_serve::paged_attention`` (vLLM's approach).

One guard check and one compiled call per step instead of one per fused function; Inductor
fuses norms, rotary, SwiGLU and residual adds and calls the GEMMs directly. If compilation
fails the model logs a warning and runs eagerly from then on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.attention.metadata import AttentionMetadata

log = logging.getLogger(__name__)

#: values of ``compile_mode`` (``EngineConfig.compile_mode``): the whole forward ("model"), only
#: the elementwise functions (``engine.layers.pointwise``, "ops"), or eager ("none")
COMPILE_MODES = ("model", "ops", "none")

#: Graphs a healthy engine compiles for the whole-model forward: prefill/mixed steps, decode steps
#: of 2+ sequences, and T == 1 (one decode or a 1-token prompt; 0/1 sizes are specialised), plus
#: one spare. More than this means something recompiles per step; each one is logged at WARNING.
EXPECTED_GRAPHS = 4

_graphs_compiled = 0


def compiled_graph_count() -> int:
    """Graphs Inductor compiled for whole-model forwards in this process.

    Process-wide, like Dynamo's cache: compiled code is cached per Python code object, so model
    instances of one architecture share it (the weights are graph inputs, not constants). A GPU
    benchmark can read it before and after its timed steps: any increase is a recompile.
    """
    return _graphs_compiled


def _inductor_counting(gm: torch.fx.GraphModule, example_inputs):
    """The Inductor backend, counting and logging each graph it compiles (runs only at compile
    time)."""
    global _graphs_compiled
    from torch._inductor.compile_fx import compile_fx

    _graphs_compiled += 1
    level = logging.INFO if _graphs_compiled <= EXPECTED_GRAPHS else logging.WARNING
    log.log(
        level,
        "torch.compile: model forward graph %d (expected at most %d; TORCH_LOGS=recompiles "
        "names the guard that failed)",
        _graphs_compiled,
        EXPECTED_GRAPHS,
    )
    return compile_fx(gm, example_inputs)


class CompiledForward:
    """``forward(input_ids, positions, kv_caches, meta)`` compiled as one graph, eager on failure.

    Args:
        forward: the eager forward; its attention layers must call the custom op.

    ``dynamic=True``: the token count T and the metadata ints (max_query_len, max_seq_len) are
    symbolic from the first compile; values 0/1 are still specialised, so T == 1 and
    max_query_len == 1 (decode) get their own graphs. B and the block-table width are unbacked
    (see :meth:`_mark_shapes`).
    """

    def __init__(self, forward: Callable[..., torch.Tensor]):
        self._eager = forward
        self._compiled = torch.compile(
            forward, backend=_inductor_counting, dynamic=True, fullgraph=True
        )
        self._marked_caches = None

    def __call__(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        if self._compiled is not None:
            self._mark_shapes(kv_caches, meta)
            try:
                return self._compiled(input_ids, positions, kv_caches, meta)
            except torch._dynamo.exc.TorchDynamoException as e:  # compile failure: nothing ran yet
                log.warning("torch.compile of the model failed, running eagerly from now on: %s", e)
                self._compiled = None
        return self._eager(input_ids, positions, kv_caches, meta)

    def _mark_shapes(self, kv_caches, meta: AttentionMetadata) -> None:
        """Shape hints for Dynamo that keep the number of compiled graphs small.

        * The KV caches never change shape: ``mark_static`` makes their sizes constants instead
          of symbols (no duck-sizing coincidence such as ``block_size == T`` can specialise a
          graph). Done once per cache list.
        * The batch size B and the block-table width only reach the attention op, so they are
          marked *unbacked*: no 0/1 specialisation, hence no extra graph for one sequence or one
          KV block. The marks live on the step's tensors, so they are set on every call.

        The token count T stays an ordinary (backed) dynamic size: its value guides Inductor,
        and T == 1 (a batch-1 decode) gets its own graph.
        """
        if self._marked_caches is not kv_caches:
            for k_cache, v_cache in kv_caches:
                torch._dynamo.mark_static(k_cache)
                torch._dynamo.mark_static(v_cache)
            self._marked_caches = kv_caches
        mark_unbacked = torch._dynamo.decorators.mark_unbacked
        mark_unbacked(meta.block_tables, 0)
        mark_unbacked(meta.block_tables, 1)
        mark_unbacked(meta.seq_lens, 0)
        mark_unbacked(meta.cu_seqlens_q, 0)
