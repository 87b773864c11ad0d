"""The speculative-decoding part of LLMEngine's step: asking the proposer for drafts before a step,
verifying them after it. Inactive (never called) while no proposer is set."""

from __future__ import annotations

import time

import torch

from pagellm.engine.step_update import StepUpdate, finished_status
from pagellm.sampling import SamplingRow, build_sampling_metadata, expand_rows_for_verify
from pagellm.spec_decode import BaseProposer, DraftRequest, SpecDecodeStats, check_proposals, split_spec_rows


class SpecDecodeStep:
    """Mixed into LLMEngine (uses its scheduler, output_processor, sampler and sampling helpers)."""

    def set_proposer(self, proposer: BaseProposer | None) -> None:
        """Speculative decoding with `proposer` from the next step on (None: off). Outputs stay those of
        plain decoding (greedy: token-identical; sampled: same distribution), with fewer steps when
        drafts are accepted. Resets `spec_stats`. Raises TypeError for a non-BaseProposer, ValueError
        when a waiting prompt plus num_speculative_tokens lookahead slots no longer fits the KV cache."""
        if proposer is not None and not isinstance(proposer, BaseProposer):
            raise TypeError(f"proposer must be a BaseProposer or None, got {type(proposer).__name__}")
        self.scheduler.set_num_lookahead_tokens(0 if proposer is None else proposer.num_speculative_tokens)
        self.proposer = proposer
        self.spec_stats = SpecDecodeStats()

    def _propose_drafts(self, in_step: list[str]) -> None:
        """Ask the proposer about every decode-ready sequence; hand its checked drafts to the scheduler.
        The decode-ready sequences are appended to `in_step`: a failure here fails their requests."""
        requests = []
        ready = self.scheduler.decode_ready_request_ids()
        in_step.extend(ready)
        for sid in ready:
            st, seq = self.output_processor.seq(sid)
            req = DraftRequest.for_sequence(sid, st.prompt_token_ids, seq.output_token_ids, st.params.max_tokens,
                                            self.max_model_len, self.proposer.num_speculative_tokens)
            if req is not None and not seq.finished:
                requests.append(req)
        if requests:
            proposals = self.proposer.propose(requests)
            drafts = check_proposals(requests, proposals, self.proposer.num_speculative_tokens, self.vocab_size)
            for sid, tokens in drafts.items():
                self.scheduler.set_draft_tokens(sid, tokens)

    def _sample_and_verify(self, sched_out, seq_ids: list[str], logits: torch.Tensor) -> StepUpdate:
        """A step with spec rows: plain sampling rows are sampled as usual, spec rows verified; each spec
        row's accepted tokens are appended one by one with stop checks (a stop truncates the run)."""
        split = split_spec_rows(sched_out)
        update = StepUpdate()
        if len(split.plain_rows):
            targets, rows, logit_rows = self._build_sampling_rows(seq_ids, split.plain_rows)
            token_ids, logprob_lists = self._sample(logits[split.plain_logit_rows], rows, logit_rows)
            update = self._apply_sampled_tokens(targets, token_ids, logprob_lists)
        seqs = [self.output_processor.seq(seq_ids[r]) for r in split.spec_rows]
        rows = [SamplingRow(st.params, st.prompt_token_ids, seq.output_token_ids,
                            self._generator(seq.seq_id, st.params, seq.index)) for st, seq in seqs]
        spec_logits = logits[split.spec_logit_rows]
        md = build_sampling_metadata(expand_rows_for_verify(rows, split.draft_token_ids), self.vocab_size,
                                     device=spec_logits.device)
        verified = self.sampler.verify(spec_logits, split.draft_token_ids, md)
        lt = verified.logprobs
        lists = None if lt is None else (lt.token_ids.tolist(), lt.logprobs.tolist(), lt.ranks.tolist())
        now, start = time.time(), 0
        for (st, seq), drafts, tokens in zip(seqs, split.draft_token_ids, verified.accepted_token_ids):
            lp_rows = None if lists is None else [tuple(col[start + j] for col in lists) for j in range(len(tokens))]
            kept = st.append_tokens(seq, tokens, lp_rows)
            update.tokens_by_seq[seq.seq_id] = tokens[:kept]
            if seq.finished:
                update.finished.append((seq.seq_id, finished_status(seq.finish_reason)))
            st.metrics.last_token_time = now
            update.changed[st.request_id] = st
            self.num_generation_tokens_total += kept
            self.spec_stats.record(len(drafts), len(tokens) - 1, kept)
            start += len(drafts) + 1
        return update
