"""The ranks 1..N-1 of a tensor-parallel engine: each a process that runs its shard of the model
for every step rank 0 announces.

A rank builds the same :class:`~engine.worker.model_runner.ModelRunner` as rank 0 over its
shard (weights, KV heads, CUDA graphs with the collectives captured, attention kernels), then
loops: receive a step message (``engine.worker.control_channel``), rebuild the step's arrays
(``engine.worker.step_message``, vectorised: no request objects here), run
:meth:`ModelRunner.execute` (the same collectives as rank 0, in the same order) and, when the
step samples, receive rank 0's sampled ids by a device broadcast, kept on the device for the
next step's tokens in flight (async scheduling). The host never waits for the device, so it runs
ahead exactly as rank 0 does.

A rank that raises logs the error and exits (code 1): the collectives of a step cannot go on
without it, and rank 0's monitor turns the exit into the engine's failure
(``engine.worker.rank_monitor``). Ranks spawned by rank 0 die with it (Linux parent-death
signal) and leave when its sockets close; ranks started by torchrun leave when rank 0's
heartbeat stops.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import torch

from engine.core.config import EngineConfig, ModelConfig, resolve_quantization
from engine.core.parent_death import set_parent_death_signal
from engine.worker.block_table import RowBlockTables
from engine.worker.control_channel import ControlChannel
from engine.worker.model_runner import ModelRunner
from engine.worker.parallel_state import init_rank, store_address, torchrun_rank
from engine.worker.rank_monitor import Heartbeat
from engine.worker.step_message import KIND, SHUTDOWN, decode_step

log = logging.getLogger(__name__)

#: exit code of a rank that failed (rank 0 logs it)
FAILED_EXIT_CODE = 1


def serve_steps(runner: ModelRunner, channel: ControlChannel) -> int:
    """Run steps until rank 0's shutdown message; returns the number of steps run.

    Raises:
        RuntimeError: rank 0 is gone (the control group's error), or what a step raises.
    """
    tables = RowBlockTables(runner.block_tables.width)
    prev: torch.Tensor | None = None  # the last step's sampled ids (on the device)
    steps = 0
    with torch.inference_mode():
        while True:
            msg = channel.recv()
            if msg[KIND] == SHUTDOWN:
                return steps
            inp = decode_step(msg, tables)
            runner.execute(inp, prev)
            n = len(inp.logits_indices)
            if n:
                ids = torch.empty(n, dtype=torch.int64, device=runner.device)
                prev = runner.tp.broadcast_from_first(ids)
            else:
                prev = None
            steps += 1


def run_rank(config: EngineConfig, rank: int, size: int, local_rank: int, init_method: str) -> int:
    """Be rank ``rank`` of ``size`` until rank 0 shuts the engine down; returns the steps run.

    Raises:
        ValueError: shapes that do not split over ``size`` ranks (every rank checks before the
            rendezvous, so none waits for a rank that refused), bad settings, a bad checkpoint.
        RuntimeError: rank 0 is gone, or a step failed.
    """
    model_config = ModelConfig.from_hf(config.model)
    model_config.check_tensor_parallel(
        size, resolve_quantization(model_config, config.quantization)
    )
    ctx = init_rank(config.device, rank, size, local_rank, init_method)
    heartbeat = None
    if init_method == "env://":  # not rank 0's child: leave when its heartbeat stops

        def lost(message: str) -> None:
            log.error("rank %d: %s; leaving the engine", rank, message)
            _exit(FAILED_EXIT_CODE)

        heartbeat = Heartbeat(store_address(init_method), rank, [0], lost).start()
    runner = ModelRunner(model_config, config, rank=ctx)
    ctx.gather_objects(runner.rank_layout)
    log.info("rank %d ready: %s", rank, runner.rank_layout.describe())
    steps = serve_steps(runner, ControlChannel(ctx.control, rank))
    if heartbeat is not None:
        heartbeat.stop()
    ctx.close()
    log.info("rank %d stopped after %d steps", rank, steps)
    return steps


def _exit(code: int) -> None:
    """Flush the logs and end the process now (no interpreter teardown: a collective may be
    blocked in another thread)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (rank 0 killed by a signal runs no
    clean-up that would end its ranks; elsewhere the control group's errors still end us)."""
    set_parent_death_signal(signal.SIGKILL)


def spawned_rank_main(
    config: EngineConfig,
    rank: int,
    size: int,
    init_method: str,
    parent_pid: int,
    log_level: int,
) -> None:
    """Entry point of a rank process spawned by rank 0 on its host (local index = rank).

    It ignores SIGTERM and SIGINT, which launchers send the whole process group: rank 0 ends it
    (the shutdown message), and it dies with rank 0 (parent-death signal)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(FAILED_EXIT_CODE)
    logging.basicConfig(
        level=log_level,
        format=f"%(asctime)s %(levelname)s %(name)s[rank {rank}]: %(message)s",
    )
    try:
        run_rank(config, rank, size, rank, init_method)
    except BaseException:  # noqa: BLE001 - log it; rank 0 sees the exit
        log.exception("tensor-parallel rank %d failed", rank)
        _exit(FAILED_EXIT_CODE)
    _exit(0)


def torchrun_rank_main(config: EngineConfig) -> int:
    """Entry point of a rank other than 0 started by torchrun (``--distributed-init-method
    env://``): the ``python -m server`` of such a rank serves no HTTP, it runs this. Returns the
    process exit code (0 after rank 0's shutdown).

    Raises:
        ValueError: torchrun's variables missing or inconsistent, or this is rank 0.
    """
    rank, local_rank = torchrun_rank(config.tensor_parallel_size)
    if rank == 0:
        raise ValueError("rank 0 serves HTTP and runs the engine core, not a worker loop")
    _die_with_parent()  # torchrun's agent is the parent
    try:
        run_rank(config, rank, config.tensor_parallel_size, local_rank, "env://")
    except BaseException:  # noqa: BLE001 - log it; rank 0's heartbeat watch sees the exit
        log.exception("tensor-parallel rank %d failed", rank)
        _exit(FAILED_EXIT_CODE)
    return 0
