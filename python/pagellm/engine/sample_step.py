"""The engine's sampling half of a step (a mixin of LLMEngine): prompt logprobs of the step's prompt chunks, one
sampling row per sampled token (n > 1 prefills expand into n rows; plain-greedy batches build none), the sampler
call, and the sampled tokens appended to their sequences with stop checks and token-time metrics.

Uses the engine's `output_processor`, `sampler`, `vocab_size`, `device`, `_generators` (seq id -> the seeded
request's torch.Generator, on the model's device) and `num_generation_tokens_total`.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from pagellm.engine.output_processor import child_seq_id
from pagellm.engine.step_update import SampleTarget, StepUpdate, finished_status
from pagellm.sampling import SamplingRow, build_sampling_metadata, compute_prompt_logprobs
from pagellm.sampling.metadata import plain_greedy_metadata
from pagellm.sampling_params import SamplingParams


class SampleStep:
    def _record_prompt_logprobs(self, sched_out, seq_ids: list[str], rows: list[int],
                                prompt_logits: dict[int, torch.Tensor]) -> None:
        """Append the prompt logprobs of this step's chunks: position p predicts prompt token p + 1."""
        if not rows:
            return
        num_computed, num_scheduled = sched_out.num_computed_tokens, sched_out.num_scheduled_tokens
        for r in rows:
            st, _ = self.output_processor.seq(seq_ids[r])
            start = int(num_computed[r])
            first = max(start, len(st.prompt_logprobs) - 1)  # skip positions already recorded
            end = min(start + int(num_scheduled[r]), len(st.prompt_token_ids) - 1)
            if end <= first:
                continue
            targets = torch.tensor(st.prompt_token_ids[first + 1 : end + 1], dtype=torch.int64)
            k = st.params.prompt_logprobs
            lt = compute_prompt_logprobs(prompt_logits[r][first - start : end - start], targets, k)
            for ids, lps, ranks in zip(lt.token_ids.tolist(), lt.logprobs.tolist(), lt.ranks.tolist()):
                st.prompt_logprobs.append(st.make_logprobs_dict(ids, lps, ranks, k))

    def _generator(self, seq_id: str, params: SamplingParams, index: int) -> torch.Generator | None:
        """The per-sequence generator of a seeded request (sequence i seeded seed + i)."""
        gen = self._generators.get(seq_id)
        if gen is None and params.seed is not None:
            gen = self._generators[seq_id] = torch.Generator(device=self.device).manual_seed(params.seed + index)
        return gen

    def _build_sampling_rows(
        self, seq_ids: list[str], sampling_rows: np.ndarray
    ) -> tuple[list[SampleTarget], list[SamplingRow] | None, list[int] | None]:
        """One SamplingRow per sampled token. A finished prefill of an n > 1 request expands into n rows
        over the same logits; children are created only once their tokens are applied. Returns the
        targets, the rows and, when something expanded, the logits row each sampling row reads. When
        every row is plain greedy (RequestState.plain_greedy: nothing expands) the rows are None: the
        tokens are the argmax of the logits rows, with no sampling metadata built."""
        seq_of = self.output_processor.seq
        states = [seq_of(seq_ids[r]) for r in np.asarray(sampling_rows).tolist()]
        if all(st.plain_greedy for st, _ in states):  # argmax rows: no SamplingRow needed
            return [SampleTarget(st, seq.index, False) for st, seq in states], None, None
        targets: list[SampleTarget] = []
        rows: list[SamplingRow] = []
        logit_rows: list[int] = []
        expanded = False
        for k, (st, seq) in enumerate(states):
            expand = seq.index == 0 and st.params.n > 1 and len(st.seqs) == 1
            expanded |= expand
            for i in range(st.params.n) if expand else [seq.index]:
                is_new_child = expand and i > 0
                sid = child_seq_id(st.request_id, i)
                out_ids = [] if is_new_child else seq.output_token_ids
                rows.append(SamplingRow(st.params, st.prompt_token_ids, out_ids, self._generator(sid, st.params, i)))
                targets.append(SampleTarget(st, i, is_new_child))
                logit_rows.append(k)
        return targets, rows, logit_rows if expanded else None

    def _sample(
        self, logits: torch.Tensor, rows: list[SamplingRow] | None, logit_rows: list[int] | None
    ) -> tuple[list[int], tuple[list, list, list] | None]:
        """Sampled token ids, and (token ids, logprobs, ranks) lists per row when logprobs were asked for.
        rows None: every logits row is plain greedy (the Sampler's all-greedy argmax, no per-row metadata)."""
        if rows is None:
            md = plain_greedy_metadata(len(logits), self.vocab_size)
            return (self.sampler(logits, md).sampled_token_ids.tolist() if len(logits) else []), None
        if not rows:
            return [], None
        if logit_rows is not None:
            logits = logits[logit_rows]
        sout = self.sampler(logits, build_sampling_metadata(rows, self.vocab_size, device=logits.device))
        lt = sout.logprobs
        logprob_lists = None if lt is None else (lt.token_ids.tolist(), lt.logprobs.tolist(), lt.ranks.tolist())
        return sout.sampled_token_ids.tolist(), logprob_lists

    def _apply_sampled_tokens(self, targets: list[SampleTarget], token_ids: list[int],
                              logprob_lists: tuple[list, list, list] | None) -> StepUpdate:
        """Append each token to its sequence (forking the children of an expanded prefill first), with
        stop checks and token-time metrics; collects what the scheduler and the outputs need."""
        update = StepUpdate()
        now = time.time()  # tokens exist from here on (TTFT / TPOT)
        for j, (st, index, is_new_child) in enumerate(targets):
            token = int(token_ids[j])
            if is_new_child and len(st.seqs) == 1:
                self.output_processor.add_children(st)
            seq = st.seqs[index]
            if is_new_child:
                update.forks.append((st.request_id, seq.seq_id, token))
            else:
                update.token_by_seq[seq.seq_id] = token
            if st.metrics.first_token_time is None:
                st.metrics.first_token_time = now
            st.metrics.last_token_time = now
            logprob_row = None if logprob_lists is None else tuple(lists[j] for lists in logprob_lists)
            if st.append_token(seq, token, logprob_row):
                update.finished.append((seq.seq_id, finished_status(seq.finish_reason)))
            update.changed[st.request_id] = st
            self.num_generation_tokens_total += 1
        return update
