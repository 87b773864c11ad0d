"""Pipeline parallelism: the decoder layers split into contiguous stages, one stage per group of ranks.

    rank grid (tp x pp): global rank = pp_rank * tp_size + tp_rank
    stage s holds layers stage_layer_range(L, s, pp); stage 0 also the embedding, the last stage the final
    norm + LM head (and the embedding too when the head is tied to it)

Every rank receives the same SchedulerOutput. Stage s > 0 receives (hidden, residual) [T, H] from the rank
with its tp_rank in stage s-1 (T = the step's scheduled tokens, known to every stage, so no shape is sent),
runs its layers and sends on; the last stage computes the logits and its output is the step's output. A
stage's KV cache holds only its own layers; block ids are shared: the driver's one block manager decides
them for every stage (each stage sizes its cache for 1/pp of the layers from 1/(tp*pp) of the memory, so
every stage fits the same number of blocks).

Micro-batches in flight (pipeline_microbatching, on by default): without them every stage idles while the
others run (stage s waits for s-1's activations, the driver waits for the last stage). With them:
  - the C++ scheduler hands out up to pp SchedulerOutputs before the first one's tokens are known
    (`set_max_steps_in_flight`), over disjoint requests, each an even share of the live ones with its own
    block allocations; a request of a pending step is "in flight" (set at schedule time, cleared by its
    step's update) and is neither scheduled again nor chosen as a preemption victim until then;
  - the mp executor writes step k+1 to every rank while step k still runs on a later stage
    (`submit_model`; one FIFO of outstanding calls, replies matched by position, oldest first), and the
    engine loop (engine/batch_queue.py) is schedule -> submit -> collect the oldest step;
  - an abort frees a request's blocks at once even while its step is in flight (every stage runs the steps
    in order, so the step's late writes land before any later step can reuse the blocks) and the collected
    step skips its row; a step that fails fails only its own requests and closes only its pending step.
Activations still go stage to stage with blocking send / recv (in step order on every pair of stages): stage
0 computes step k+1 while the next stage runs step k; its send may then wait for that stage's receive. A stage
whose step raises before its activations moved still receives / sends them (`stage_step`, zeros sent), so
the next stage never takes step k+1's activations for step k's and the engine goes on.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from pagellm.distributed.parallel_state import get_pp_state


def stage_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the decoder layers stage `pp_rank` of `pp_size` holds: contiguous, as even as possible
    (the first num_layers % pp_size stages hold one more). ValueError when a stage would hold none."""
    for name, value in (("num_layers", num_layers), ("pp_size", pp_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size ({pp_size}) is more than the model's {num_layers} decoder layers: "
                         f"every stage needs at least one")
    if isinstance(pp_rank, bool) or not isinstance(pp_rank, int) or not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank must be an integer in [0, {pp_size}), got {pp_rank!r}")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


class StageAbsent(nn.Module):
    """Stands where a module of another pipeline stage would be: no parameters (the loader skips the
    checkpoint tensors under its name without reading them), and it is never called."""

    def __init__(self, what: str = "") -> None:
        super().__init__()
        self.what = what

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.what or 'this module'} belongs to another pipeline stage")


def absent_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Name prefixes ("model.layers.3.") of the modules `model` leaves to other pipeline stages."""
    return tuple(f"{name}." for name, m in model.named_modules() if isinstance(m, StageAbsent))


def send_activations(hidden: torch.Tensor, residual: torch.Tensor) -> None:
    """Send this stage's output (hidden, residual), each [T, H], to the next stage (blocking)."""
    import torch.distributed as dist  # noqa: PLC0415

    state = get_pp_state()
    if state.next_rank is None:
        raise RuntimeError(f"pipeline stage {state.rank} of {state.size} has no next stage to send to")
    if hidden.shape[0] == 0:  # both sides know T: nothing to send for an empty step
        return
    dist.send(hidden.contiguous(), dst=state.next_rank)
    dist.send(residual.contiguous(), dst=state.next_rank)
    state.traffic.num_sent += 1


def recv_activations(num_tokens: int, hidden_size: int, dtype: torch.dtype,
                     device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The previous stage's (hidden, residual), each [num_tokens, hidden_size] (blocking)."""
    import torch.distributed as dist  # noqa: PLC0415

    state = get_pp_state()
    if state.prev_rank is None:
        raise RuntimeError(f"pipeline stage {state.rank} of {state.size} has no previous stage to receive from")
    hidden = torch.empty((num_tokens, hidden_size), dtype=dtype, device=device)
    residual = torch.empty_like(hidden)
    if num_tokens:
        dist.recv(hidden, src=state.prev_rank)
        dist.recv(residual, src=state.prev_rank)
        state.traffic.num_received += 1
    return hidden, residual


@contextmanager
def stage_step(num_tokens: int, hidden_size: int, dtype: torch.dtype,
               device: torch.device | str = "cpu") -> Iterator[None]:
    """One step of T = `num_tokens` on this stage. When it raises before it received the previous stage's
    activations, they are received (and dropped) on the way out; before it sent its own, zeros are sent. So
    the stages stay at the same step: the step fails (the driver fails its requests and never caches their
    KV) and the next steps run as usual, instead of the next stage waiting forever or taking step k+1's
    activations for step k's."""
    state = get_pp_state()
    received, sent = state.traffic.num_received, state.traffic.num_sent
    try:
        yield
    except BaseException:
        if state.prev_rank is not None and state.traffic.num_received == received:
            recv_activations(num_tokens, hidden_size, dtype, device)
        if state.next_rank is not None and state.traffic.num_sent == sent:
            zeros = torch.zeros((num_tokens, hidden_size), dtype=dtype, device=device)
            send_activations(zeros, zeros)
        raise


def check_kv_sharing_within_stages(kv_sharing: dict[int, int]) -> None:
    """ValueError when a layer reads the KV cache of a layer on another pipeline stage (each stage holds only
    its own layers' caches). `kv_sharing`: reading layer -> owning layer."""
    state = get_pp_state()
    if state.size == 1:
        return
    crossing = {i: t for i, t in kv_sharing.items() if state.owns_layer(i) != state.owns_layer(t)}
    if crossing:
        raise ValueError(f"pipeline_parallel_size={state.size}: layers {sorted(crossing)} read the KV cache of layers "
                         f"on another stage ({crossing}); cross-stage KV sharing is not supported")
