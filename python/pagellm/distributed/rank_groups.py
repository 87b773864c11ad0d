"""The rank grid every out-of-process executor ("mp", "ray") builds: tensor_parallel_size x
pipeline_parallel_size ranks in one gloo world.

    global rank = pp_rank * tp_size + tp_rank
    stage s = ranks [s * tp, (s + 1) * tp): one tensor-parallel group each; stage s sends its activations
    to the rank with its tp_rank in stage s + 1; tp rank 0 of the last stage (`output_rank`) returns the
    step's output (the others' are copies, or nothing on earlier stages)

One definition for both executors: only how the ranks are started and reached differs (spawned processes
and pipes, or Ray actors and object refs), never what a rank joins.
"""

from __future__ import annotations

from datetime import timedelta


def output_rank(tp_size: int, pp_size: int = 1) -> int:
    """The global rank whose step output is the step's output: tp rank 0 of the last pipeline stage."""
    return (pp_size - 1) * tp_size


def join_rank_groups(rank: int, tp_size: int, pp_size: int, init_method: str, timeout: timedelta,
                     num_layers: int, shm_name: str | None = None) -> None:
    """Init the gloo world of tp_size * pp_size ranks at `init_method` ("tcp://host:port"); set this rank's
    tensor-parallel group and pipeline stage (its layer range, the neighbouring stages' ranks). With
    `shm_name` (the executor's base name; same host only) the stage's TP group also gets a shared-memory
    all-reduce."""
    import torch.distributed as dist  # noqa: PLC0415

    from pagellm.distributed.parallel_state import (  # noqa: PLC0415
        PipelineParallelState, TensorParallelState, set_pp_state, set_tp_state,
    )
    from pagellm.distributed.pipeline import stage_layer_range  # noqa: PLC0415

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=tp_size * pp_size, timeout=timeout)
    tp_rank, pp_rank = rank % tp_size, rank // tp_size
    group = dist.group.WORLD
    if pp_size > 1 and tp_size > 1:  # every rank creates every stage's group, in the same order
        stage_groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) for s in range(pp_size)]
        group = stage_groups[pp_rank]
    if tp_size > 1:
        shm = None
        if shm_name is not None:
            from pagellm.distributed.shm_comm import ShmCommunicator, stage_segment_name  # noqa: PLC0415

            shm = ShmCommunicator(stage_segment_name(shm_name, pp_rank), tp_rank, tp_size)
        set_tp_state(TensorParallelState(tp_rank, tp_size, group, shm))
    if pp_size > 1:
        start, end = stage_layer_range(num_layers, pp_rank, pp_size)
        set_pp_state(PipelineParallelState(
            pp_rank, pp_size, start, end, prev_rank=rank - tp_size if pp_rank > 0 else None,
            next_rank=rank + tp_size if pp_rank < pp_size - 1 else None))
