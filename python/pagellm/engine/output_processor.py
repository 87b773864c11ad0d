"""Per-request output state: tokens, incremental text, logprobs, stop checks, RequestOutputs.

A request with n > 1 has n sequences: index 0 is the request itself (scheduler id = request id),
indices 1..n-1 are children forked after the prompt's prefill (scheduler ids f"{rid}#{i}").
Python decides every stop: EOS (unless ignore_eos), stop_token_ids, stop strings, max_tokens and
max_model_len, with EOS / stop ids masked until min_tokens were generated.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

from pagellm.engine.detokenizer import IncrementalDetokenizer, StopStringChecker, decode_tokens
from pagellm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagellm.sampling.metadata import is_plain_greedy
from pagellm.sampling_params import RequestOutputKind, SamplingParams

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_ERROR = "error"


def child_seq_id(request_id: str, index: int) -> str:
    return request_id if index == 0 else f"{request_id}#{index}"


@dataclass
class SequenceState:
    seq_id: str
    index: int
    detokenizer: IncrementalDetokenizer | None
    stop_checker: StopStringChecker
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float, tokenizer, max_model_len: int) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        self.seqs: list[SequenceState] = [self._new_seq(0)]
        # one sequence sampled as the argmax of the raw logits, nothing else asked of the sampler (the engine's greedy
        # fast path: no SamplingRow, no metadata)
        self.plain_greedy = params.n == 1 and is_plain_greedy(params)
        self.final_only = params.output_kind == RequestOutputKind.FINAL_ONLY  # step() returns only its last output

    # ------------------------------------------------------------------ sequences
    def _new_seq(self, index: int) -> SequenceState:
        p = self.params
        detok = None
        if p.detokenize and self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, self.prompt_token_ids, p.skip_special_tokens,
                                           p.spaces_between_special_tokens)
        return SequenceState(
            seq_id=child_seq_id(self.request_id, index), index=index, detokenizer=detok,
            stop_checker=StopStringChecker(p.stop, p.include_stop_str_in_output),
            logprobs=[] if p.logprobs is not None else None,
            cumulative_logprob=0.0 if p.logprobs is not None else None,
        )

    def add_children(self) -> list[str]:
        """Create sequences 1..n-1 (after the parent's prefill); returns their scheduler ids."""
        for i in range(1, self.params.n):
            self.seqs.append(self._new_seq(i))
        return [s.seq_id for s in self.seqs[1:]]

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.finished for s in self.seqs)

    # ------------------------------------------------------------------ tokens
    def _decode_one(self, tid: int) -> str | None:
        if self.tokenizer is None or not self.params.detokenize:
            return None
        return decode_tokens(self.tokenizer, [tid], skip_special_tokens=False)

    def make_logprobs_dict(self, ids: Sequence[int], lps: Sequence[float], ranks: Sequence[int], k: int) -> dict[int, Logprob]:
        """Column 0 = the sampled/actual token, then the top-k (deduplicated)."""
        out: dict[int, Logprob] = {}
        for j in range(min(len(ids), k + 1)):
            tid = int(ids[j])
            if tid not in out:
                out[tid] = Logprob(float(lps[j]), int(ranks[j]), self._decode_one(tid))
        return out

    def append_token(self, seq: SequenceState, token_id: int, logprob_row: tuple | None = None) -> bool:
        """Append one sampled token to `seq`; returns True if the sequence finished."""
        if seq.finished:
            return True
        p = self.params
        seq.output_token_ids.append(token_id)
        n_out = len(seq.output_token_ids)
        if logprob_row is not None and seq.logprobs is not None:
            ids, lps, ranks = logprob_row
            seq.logprobs.append(self.make_logprobs_dict(ids, lps, ranks, p.logprobs))
            seq.cumulative_logprob += float(lps[0])

        stopped_by_token = False
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token_id in p.eos_token_ids:
                seq.finish_reason, seq.stop_reason = FINISH_STOP, None
                stopped_by_token = True
            elif token_id in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = FINISH_STOP, token_id
                stopped_by_token = True

        if seq.detokenizer is not None and (not stopped_by_token or p.include_stop_str_in_output):
            delta = seq.detokenizer.update([token_id])
            if stopped_by_token:
                delta += seq.detokenizer.flush()
            if seq.stop_checker.append(delta, check=n_out >= p.min_tokens) and not seq.finished:
                seq.finish_reason, seq.stop_reason = FINISH_STOP, seq.stop_checker.stop_str

        if not seq.finished:
            if p.max_tokens is not None and n_out >= p.max_tokens:
                seq.finish_reason = FINISH_LENGTH
            elif len(self.prompt_token_ids) + n_out >= self.max_model_len:
                seq.finish_reason = FINISH_LENGTH
        if seq.finished and seq.detokenizer is not None and seq.stop_checker.stop_str is None:
            seq.stop_checker.append(seq.detokenizer.flush())
        return seq.finished

    def append_tokens(self, seq: SequenceState, token_ids: Sequence[int],
                      logprob_rows: Sequence[tuple] | None = None) -> int:
        """Append a run of tokens (a spec row's accepted drafts + one) one by one with the stop checks
        of append_token; a stop inside the run drops the rest. Returns the number kept."""
        for j, token_id in enumerate(token_ids):
            if seq.finished:
                return j
            self.append_token(seq, int(token_id), None if logprob_rows is None else logprob_rows[j])
        return len(token_ids)

    def abort(self, finish_reason: str = FINISH_ABORT) -> None:
        while len(self.seqs) < self.params.n:
            self.seqs.append(self._new_seq(len(self.seqs)))
        for s in self.seqs:
            if not s.finished:
                s.finish_reason = finish_reason

    # ------------------------------------------------------------------ outputs
    def make_output(self) -> RequestOutput:
        finished = self.finished
        now = time.time()
        if finished and self.metrics.finished_time is None:
            self.metrics.finished_time = now
        self.metrics.num_generation_tokens = max((len(s.output_token_ids) for s in self.seqs), default=0)
        outs = []
        for s in self.seqs:
            text = s.stop_checker.visible_text(s.finished)
            outs.append(CompletionOutput(
                index=s.index, text=text, token_ids=list(s.output_token_ids),
                cumulative_logprob=s.cumulative_logprob,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason,
            ))
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=list(self.prompt_token_ids),
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
            outputs=outs, finished=finished, metrics=self.metrics, num_cached_tokens=self.num_cached_tokens,
        )


class OutputProcessor:
    """All live requests' states, keyed by request id and by scheduler sequence id."""

    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.requests: dict[str, RequestState] = {}
        self.seq_to_req: dict[str, tuple[RequestState, int]] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float) -> RequestState:
        st = RequestState(request_id, prompt, prompt_token_ids, params, arrival_time, self.tokenizer, self.max_model_len)
        self.requests[request_id] = st
        self.seq_to_req[request_id] = (st, 0)
        return st

    def add_children(self, st: RequestState) -> list[str]:
        ids = st.add_children()
        for s in st.seqs[1:]:
            self.seq_to_req[s.seq_id] = (st, s.index)
        return ids

    def seq(self, seq_id: str) -> tuple[RequestState, SequenceState]:
        st, i = self.seq_to_req[seq_id]
        return st, st.seqs[i]

    def remove(self, st: RequestState) -> None:
        self.requests.pop(st.request_id, None)
        for s in st.seqs:
            self.seq_to_req.pop(s.seq_id, None)

    def abort(self, request_id: str) -> tuple[RequestState, list[str]] | None:
        """Mark a request aborted; returns it and the ids of its sequences that were still live."""
        st = self.requests.get(request_id)
        if st is None:
            return None
        live = [s.seq_id for s in st.seqs if not s.finished]
        st.abort()
        return st, live
