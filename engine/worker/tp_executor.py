"""Rank 0 of a tensor-parallel engine, as the engine core's model executor.

:class:`TensorParallelExecutor` implements ``engine.core.executor.ModelExecutor`` for N ranks:
the engine core (scheduler, KV cache manager, sampler bookkeeping) stays in this process and
drives rank 0's :class:`~engine.worker.model_runner.ModelRunner`; ranks 1..N-1 run in their own
processes (``engine.worker.tp_worker``). Each step:

1. rank 0 flattens the batch into its host arrays (``ModelRunner.prepare``), exactly as on one
   device;
2. it broadcasts them as one message over the gloo control group
   (``engine.worker.step_message``, ``engine.worker.control_channel``): the other ranks need no
   request objects and run no per-request Python;
3. every rank runs the step's forward on its shard; the collectives (all-reduces, the logits'
   gather to rank 0) run on the device group, inside the CUDA graphs on CUDA;
4. rank 0 samples (grammar masks, penalties, logprobs: everything that reads request state)
   and broadcasts the sampled ids on the device; every rank keeps them for the next step's
   tokens in flight, so async scheduling works unchanged.

Sampling on one rank and broadcasting (vLLM's choice, and nano-vllm's) keeps every sampling
feature in one place and costs one ``[N]`` int64 broadcast per step; sampling identically
everywhere would need every rank to hold the requests' state.

Process layout: with ``distributed_init_method`` None or ``tcp://...`` this process spawns ranks
1..N-1 on this host (``multiprocessing`` spawn, daemonic); with ``env://`` torchrun started every
rank (possibly on several hosts) and this process is RANK 0. Losing a rank ends this process
(:mod:`engine.worker.rank_monitor`): run rank 0 in the engine-core process (the server's
``--engine-mode process``), whose death the front end already handles.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
from collections.abc import Callable

import torch

from engine.core.config import EngineConfig, ModelConfig, resolve_quantization
from engine.core.layout import RankLayout, describe_layout
from engine.core.scheduler import ScheduledBatch
from engine.worker.control_channel import ControlChannel
from engine.worker.device import is_device_error
from engine.worker.model_runner import ModelRunner, StepHandle
from engine.worker.parallel_state import (
    RankContext,
    free_loopback_init_method,
    init_rank,
    store_address,
    torchrun_rank,
)
from engine.worker.rank_monitor import RankMonitor
from engine.worker.step_message import encode_shutdown, encode_step
from engine.worker.tp_worker import spawned_rank_main

log = logging.getLogger(__name__)

#: exit code of the engine process after it lost a rank
LOST_RANK_EXIT_CODE = 3
#: seconds the ranks get to leave after the shutdown message before they are killed
SHUTDOWN_GRACE_S = 10.0


class TensorParallelError(RuntimeError):
    """A step failed after its inputs went to the other ranks: the ranks' collectives are out of
    step, so the engine cannot continue (:meth:`TensorParallelExecutor.is_fatal`)."""


def exit_process(message: str) -> None:
    """The default reaction to a lost rank: log, flush, end this process now (a collective may
    be blocked in the engine thread; the interpreter's teardown would wait for it)."""
    log.error(
        "tensor-parallel engine lost a rank (%s); the engine cannot run without it and stops "
        "(its requests fail, /health answers 503)",
        message,
    )
    logging.shutdown()
    sys.stderr.flush()
    os._exit(LOST_RANK_EXIT_CODE)


class TensorParallelExecutor:
    """The model executor of an engine split over ``config.tensor_parallel_size`` ranks.

    Args:
        model_config: the architecture; config: engine settings (``tensor_parallel_size``,
            ``distributed_init_method``, ``device``: the base device of this host's ranks).
        on_fault: called with a message when a rank is lost (default :func:`exit_process`).

    Attributes:
        runner: rank 0's model runner; layout: every rank's placement (rank order).
        model_config, cache_info, description: as ``ModelExecutor``.

    Raises:
        ValueError: shapes that do not split over the ranks (naming the dimension), an
            ``env://`` launch that is not torchrun's rank 0, bad settings or checkpoint.
        RuntimeError: the rendezvous failed.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        config: EngineConfig,
        on_fault: Callable[[str], None] = exit_process,
    ):
        tp = config.tensor_parallel_size
        model_config.check_tensor_parallel(
            tp, resolve_quantization(model_config, config.quantization)
        )
        self.model_config = model_config
        self._processes: dict[int, mp.process.BaseProcess] = {}
        self._closed = False
        init = config.distributed_init_method
        if init == "env://":
            rank, local_rank = torchrun_rank(tp)
            if rank != 0:
                raise ValueError(f"the engine core must be torchrun's RANK 0, not {rank}")
        else:
            init, local_rank = init or free_loopback_init_method(), 0
            self._spawn(config, init)
        self._monitor = RankMonitor(self._processes, on_fault).start()
        try:
            self._rank: RankContext = init_rank(config.device, 0, tp, local_rank, init)
            if init == "env://":
                self._monitor.watch_heartbeats(store_address(init), list(range(1, tp)))
            self.runner = ModelRunner(model_config, config, rank=self._rank)
            self.layout: tuple[RankLayout, ...] = tuple(
                self._rank.gather_objects(self.runner.rank_layout)
            )
        except BaseException:
            self._monitor.stop()
            self._kill_ranks()
            raise
        self._channel = ControlChannel(self._rank.control, 0)
        self.cache_info = self.runner.cache_info
        self.description = self.runner.description
        self.init_method = init
        log.info(
            "%s; devices over %s, step messages over gloo, ranks met at %s",
            describe_layout(self.layout),
            self._rank.backend,
            init,
        )

    def _spawn(self, config: EngineConfig, init: str) -> None:
        """Start ranks 1..N-1 on this host (rank r on the base device's index + r)."""
        ctx = mp.get_context("spawn")
        level = logging.getLogger().level
        for rank in range(1, config.tensor_parallel_size):
            proc = ctx.Process(
                target=spawned_rank_main,
                name=f"tp-rank-{rank}",
                daemon=True,
                args=(config, rank, config.tensor_parallel_size, init, os.getpid(), level),
            )
            proc.start()
            self._processes[rank] = proc

    # ------------------------------------------------------------- executor API
    @torch.inference_mode()
    def launch(
        self,
        batch: ScheduledBatch,
        eos_token_ids: frozenset[int],
        prev: StepHandle | None = None,
        before_sampling: Callable[[], None] | None = None,
    ) -> StepHandle:
        """As :meth:`ModelRunner.launch` on every rank: rank 0 sends the step's message, runs
        the forward with the others, calls ``before_sampling``, samples and broadcasts the ids.

        Raises:
            RuntimeError: a request with a token in flight that ``prev`` did not sample
                (nothing was sent: the engine goes on).
            TensorParallelError: the step failed once the other ranks had its inputs.
        """
        inp = self.runner.prepare(batch, prev)
        msg = encode_step(inp, self.runner.block_tables.take_changes())
        try:
            self._channel.send(msg)
            return self.runner.launch_inputs(inp, batch, eos_token_ids, prev, before_sampling)
        except Exception as exc:
            raise TensorParallelError(
                f"tensor-parallel step failed after its inputs went to the other ranks: {exc}"
            ) from exc

    def prepare_thread(self) -> None:
        """Rank 0's per-thread caches on the engine loop's thread (the other ranks step on the
        thread that built them); see :meth:`ModelRunner.prepare_thread`."""
        self.runner.prepare_thread()

    def memory_stats(self) -> dict[str, int]:
        """Rank 0's device memory (see :meth:`ModelRunner.memory_stats`)."""
        return self.runner.memory_stats()

    def is_fatal(self, exc: BaseException) -> bool:
        """A step that failed after reaching the other ranks, or a device error."""
        return isinstance(exc, TensorParallelError) or is_device_error(exc)

    def shutdown(self) -> None:
        """Tell the other ranks to leave, wait for them (then kill stragglers), leave the
        process groups. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._monitor.stop()
        clean = True
        try:
            self._channel.send(encode_shutdown())
        except Exception as exc:  # noqa: BLE001 - a rank is gone already
            log.warning("could not send the shutdown message to every rank: %s", exc)
            clean = False
        for proc in self._processes.values():
            proc.join(SHUTDOWN_GRACE_S)
            clean &= proc.exitcode == 0
        self._kill_ranks()
        if clean:
            self._rank.close()

    def _kill_ranks(self) -> None:
        """SIGKILL the ranks this process spawned that are still alive, and reap them."""
        for proc in self._processes.values():
            if proc.is_alive():
                proc.kill()
            proc.join(5)
