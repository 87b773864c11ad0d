"""What LLMEngine does when something inside its step raises: the step's requests fail, the engine goes on.

A step touches shared state in several places (the scheduler's pending step, per-request Python state,
seeded generators, KV blocks). Any of them may be half-updated when the model, the sampler, the
detokenizer or the proposer raises, so nothing of the step is kept: every request the step touched is
finished with finish_reason "error" (its final RequestOutput carries the message in `error`), aborted in
the scheduler (blocks freed) and forgotten, and the scheduler's pending step is closed without being
applied (`abort_pending_step`: the failed step's KV is never cached). Requests outside the step go on.
"""

from __future__ import annotations

from typing import Iterable

from pagellm.engine.output_processor import FINISH_ERROR, RequestState, child_seq_id
from pagellm.logger import init_logger
from pagellm.outputs import CompletionOutput, RequestOutput

logger = init_logger(__name__)


class EngineRecoveryError(RuntimeError):
    """A step failed and restoring a consistent engine failed too: the engine is unusable."""


class StepRecovery:
    """Mixed into LLMEngine (uses its scheduler, output_processor and _forget)."""

    def _fail_step(self, exc: BaseException, seq_ids: Iterable[str], step_id: int | None = 0) -> list[RequestOutput]:
        """Fail the requests of sequences `seq_ids` (all live requests when none is known, e.g. the
        scheduler itself raised) after `exc` interrupted a step, and close the scheduler's pending step
        `step_id` (0: the oldest; None: none, e.g. schedule() raised while other steps are in flight);
        returns their final outputs. Raises EngineRecoveryError when the engine cannot be brought back to
        a consistent state."""
        message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        seq_ids = list(seq_ids)
        try:
            states = self._states_of(seq_ids)
            orphans = [sid for sid in seq_ids if sid not in self.output_processor.seq_to_req]
            if isinstance(exc, Exception):
                logger.error("engine step failed; failing its %d request(s)", len(states), exc_info=exc)
            else:
                logger.warning("engine step interrupted (%s); aborting its %d request(s)", message, len(states))
            outputs = [self._fail_request(st, message) for st in states]
            for sid in orphans:  # sequences the scheduler runs but Python does not know: drop them too
                self.scheduler.abort(sid)
            # rows of already failed requests are skipped
            unknown = [] if step_id is None else self.scheduler.abort_pending_step(step_id)
            if unknown:
                logger.warning("aborted scheduler rows without a request state: %s", unknown)
        except Exception as cleanup_exc:  # noqa: BLE001 - (an interrupt during cleanup propagates as it is)
            raise EngineRecoveryError(f"engine step failed ({message}) and the engine could not recover: "
                                      f"{type(cleanup_exc).__name__}: {cleanup_exc}") from cleanup_exc
        return outputs

    def _states_of(self, seq_ids: Iterable[str]) -> list[RequestState]:
        """The live requests owning `seq_ids`, in order; every live request when `seq_ids` is empty."""
        seq_ids = list(seq_ids)
        if not seq_ids:
            return list(self.output_processor.requests.values())
        states: dict[str, RequestState] = {}
        for sid in seq_ids:
            entry = self.output_processor.seq_to_req.get(sid)
            if entry is not None and entry[0].request_id in self.output_processor.requests:
                states.setdefault(entry[0].request_id, entry[0])
        return list(states.values())

    def _fail_request(self, st: RequestState, message: str) -> RequestOutput:
        """Abort every sequence of `st` in the scheduler (those that finished in Python during the failed
        step too: the scheduler never learnt it), mark it failed, forget it; returns its final output."""
        for index in range(st.params.n):
            self.scheduler.abort(child_seq_id(st.request_id, index))  # False for unknown / finished ids
        st.abort(FINISH_ERROR)
        try:
            out = st.make_output()
        except Exception:  # noqa: BLE001 - the failure may lie in building outputs itself
            out = RequestOutput(
                request_id=st.request_id, prompt=st.prompt, prompt_token_ids=list(st.prompt_token_ids),
                prompt_logprobs=None, finished=True, metrics=st.metrics,
                outputs=[CompletionOutput(s.index, "", list(s.output_token_ids), None, None, s.finish_reason,
                                          s.stop_reason) for s in st.seqs],
            )
        out.error = message
        self._forget(st)
        return out
