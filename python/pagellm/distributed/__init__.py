"""Tensor parallelism: which rank this process is (parallel_state), the collectives the layers call
(communication), how a checkpoint tensor is cut into this rank's part (sharding; MoE experts:
expert_sharding), and the checks that refuse an unsupported set-up at start-up (validation). Pipeline
parallelism: the stage layout and the activations passed between stages (pipeline). The multi-process
executor that starts the ranks lives in pagellm.engine.mp_executor."""

from pagellm.distributed.parallel_state import (
    PipelineParallelState,
    TensorParallelState,
    get_pp_size,
    get_pp_state,
    get_tp_rank,
    get_tp_size,
    get_tp_state,
    set_pp_state,
    set_tp_state,
)

__all__ = ["PipelineParallelState", "TensorParallelState", "get_pp_size", "get_pp_state", "get_tp_rank", "get_tp_size",
           "get_tp_state", "set_pp_state", "set_tp_state"]
