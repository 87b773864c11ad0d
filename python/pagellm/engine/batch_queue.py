"""Pipeline micro-batches in the engine loop: `step()` = schedule -> submit -> collect the oldest step.

On only when the executor takes several steps at once (`max_concurrent_batches` n > 1: pipeline_parallel_size
n over "mp" or "ray", pipeline_microbatching on); otherwise LLMEngine keeps its one-step path (schedule -> execute ->
update). The scheduler then hands out up to n steps over disjoint requests (a request in flight is not
scheduled again until its step is updated) and the executor runs them on the stages at once:

    step():  if fewer than n steps are in flight: ask the proposer (if any) for drafts of the decode-ready
             requests not in flight, schedule one step and submit it; return [] while the pipeline is
             still filling.
             collect the oldest step (wait for it), sample, update the scheduler, return its outputs.

A request aborted while its step is in flight has its blocks freed at once (the step's later writes land in
free blocks, before any later step can reuse them: every stage runs the steps in order); the collected step
skips its row (and its drafts). A failed step (submit, collect, sampling) fails its own requests only and
closes its pending step in the scheduler; the other steps in flight go on.

Speculative decoding: drafts come from proposers that need only the committed tokens (ngram, or a draft
checkpoint run in this process: the driver knows every verified token first, and a draft on the last stage
would need its own messages ordered with the steps in flight). A request is drafted for just before it is
scheduled again, i.e. after its previous step was verified, so greedy output is that of plain decoding.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagellm.outputs import RequestOutput


@dataclass
class InFlightStep:
    """A submitted step: what the engine needs to apply its output once collected."""

    sched_out: Any  # the C++ SchedulerOutput
    seq_ids: list[str]
    states: list[Any]  # each row's RequestState at submit time (an aborted row's state is gone, or another)
    prompt_logprob_rows: list[int]
    handle: Any  # the executor's


class BatchQueueStep:
    """Mixed into LLMEngine (uses its scheduler, executor, output_processor and the one-step helpers)."""

    def _init_batch_queue(self) -> None:
        n = self.executor.max_concurrent_batches
        self._batch_queue: deque[InFlightStep] | None = None
        if n > 1:
            self.scheduler.set_max_steps_in_flight(n)
            self._batch_queue = deque()

    @property
    def num_steps_in_flight(self) -> int:
        """Steps submitted to the executor and not yet collected (always 0 without micro-batches)."""
        return 0 if self._batch_queue is None else len(self._batch_queue)

    def _step_with_batch_queue(self) -> list[RequestOutput]:
        queue = self._batch_queue
        if len(queue) < self.scheduler.max_steps_in_flight:
            in_step: list[str] = []
            sched_out = None
            try:
                if self.proposer is not None:  # drafts for the decode-ready requests not in flight
                    self._propose_drafts(in_step)
                in_step.clear()  # a failure inside schedule() leaves nothing known: it fails every request
                if self.lora is not None:
                    self.lora.admit_waiting()
                sched_out = self.scheduler.schedule()
                in_step.extend(sched_out.request_ids)
                if in_step:
                    queue.append(self._submit(sched_out, in_step))
                    if len(queue) < self.scheduler.max_steps_in_flight:
                        return []  # fill the pipeline before waiting for the oldest step
            except BaseException as exc:  # noqa: BLE001
                # schedule() itself failed: every live request fails (nothing else is known), no step closes
                step_id = int(sched_out.step_id) if sched_out is not None and in_step else None
                return self._fail_in_flight(exc, in_step, step_id)
        if not queue:
            return []
        step = queue.popleft()
        try:
            return self._apply_in_flight_step(step, self.executor.collect_model(step.handle))
        except BaseException as exc:  # noqa: BLE001
            return self._fail_in_flight(exc, step.seq_ids, int(step.sched_out.step_id))

    def _submit(self, sched_out, seq_ids: list[str]) -> InFlightStep:
        states = [self.output_processor.seq(sid)[0] for sid in seq_ids]
        rows = self._begin_rows(seq_ids, sched_out.num_computed_tokens)
        # a slot rewrite (set_lora_slot) reaches each rank after the steps already sent to it: steps in flight
        # keep their adapters, whose requests are still active so their slots are not reassigned
        lora_slots = None if self.lora is None else self.lora.row_slots(seq_ids)
        extra = {} if lora_slots is None else {"lora_slots": lora_slots}
        return InFlightStep(sched_out, seq_ids, states, rows, self.executor.submit_model(sched_out, rows, **extra))

    def _fail_in_flight(self, exc: BaseException, seq_ids: list[str], step_id: int | None) -> list[RequestOutput]:
        outputs = self._fail_step(exc, seq_ids, step_id=step_id)
        if not isinstance(exc, Exception):
            raise exc
        return outputs

    def _apply_in_flight_step(self, step: InFlightStep, result) -> list[RequestOutput]:
        """Sample the rows still live (those aborted in flight get no token), verify their drafts, then update
        the scheduler."""
        sched_out, seq_ids = step.sched_out, step.seq_ids
        known = self.output_processor.seq_to_req
        live = [known.get(sid, (None,))[0] is st for sid, st in zip(seq_ids, step.states)]
        prompt_rows = [r for r in step.prompt_logprob_rows if live[r]]
        if len(sched_out.draft_token_ids):  # spec rows (engine/spec_step.py)
            self._record_prompt_logprobs(sched_out, seq_ids, prompt_rows, result.prompt_logits)
            update = self._sample_and_verify(sched_out, seq_ids, result.logits, live)
            self._report_to_scheduler(sched_out, seq_ids, update)
            return self._collect_outputs(update.changed)
        sampling = np.flatnonzero(sched_out.do_sample)
        kept = [k for k, r in enumerate(sampling) if live[r]]
        logits = result.logits if len(kept) == len(sampling) else result.logits[kept]
        self._record_prompt_logprobs(sched_out, seq_ids, prompt_rows, result.prompt_logits)
        targets, rows, logit_rows = self._build_sampling_rows(seq_ids, sampling[kept])
        token_ids, logprob_lists = self._sample(logits, rows, logit_rows)
        update = self._apply_sampled_tokens(targets, token_ids, logprob_lists)
        self._report_to_scheduler(sched_out, seq_ids, update)
        return self._collect_outputs(update.changed)
