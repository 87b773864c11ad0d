"""The speculative-decoding part of LLMEngine's step: asking the proposer for drafts before a step,
verifying them after it. Inactive (never called) while no proposer is set."""

from __future__ import annotations

import time

import numpy as np
import torch

from pagellm.engine.step_update import StepUpdate, finished_status
from pagellm.engine.tree_step import (
    TreePaths,
    chain_parents,
    choose_tree_paths,
    move_kv_slots,
    reordered_drafts,
    typical_tree_paths,
    verify_greedy_paths,
)
from pagellm.logger import init_logger
from pagellm.ops.row_dispatch import gather_rows
from pagellm.outputs import SpecDecodeMetrics
from pagellm.sampling import SamplingRow, build_sampling_metadata, expand_rows_for_verify
from pagellm.sampling.metadata import plain_greedy_metadata
from pagellm.sampling.processors import argmax_rows
from pagellm.spec_decode import (
    BaseProposer,
    DraftRequest,
    ProposerContext,
    SpecDecodeStats,
    check_proposals,
    create_proposer,
    split_spec_rows,
)
from pagellm.spec_decode.batch import keep_rows
from pagellm.spec_decode.switch import SpecSwitch

logger = init_logger(__name__)


class SpecDecodeStep:
    """Mixed into LLMEngine (uses its scheduler, output_processor, sampler and sampling helpers)."""

    def _init_speculation(self, proposer: BaseProposer | None) -> None:
        """At construction: the given proposer, else the one `config.speculative_config` names."""
        spec = self.config.speculative_config
        self.sampler.set_acceptance(None if spec is None else spec.typical_acceptance)  # sampled rows' rule
        if proposer is None and spec is not None:
            context = ProposerContext(engine_config=self.config, model_files=self.model_files,
                                      tokenizer=self.tokenizer, vocab_size=self.vocab_size, executor=self.executor,
                                      target_block_table=self.scheduler.get_block_table)
            proposer = create_proposer(spec, context)
        self.set_proposer(proposer, None if spec is None else spec.disable_by_batch_size,
                          adaptive=True if spec is None else spec.adaptive,
                          adaptive_k=False if spec is None else spec.adaptive_k)

    def set_proposer(self, proposer: BaseProposer | None, disable_by_batch_size: int | None = None,
                     adaptive: bool = False, adaptive_k: bool = False) -> None:
        """Speculative decoding with `proposer` from the next step on (None: off). Outputs stay those of
        plain decoding (greedy: token-identical; sampled: same distribution), with fewer steps when
        drafts are accepted. No drafts in a step with more decode-ready sequences than
        `disable_by_batch_size` (None: the proposer's `default_disable_by_batch_size`; the switch alone let
        draft_model fall to 0.61x at batch 8 in the session-10 bench). `adaptive` (a speculative_config's default; off
        here, where the caller hands its own proposer): a sequence drafts only while its recent acceptance
        pays for the verify cost measured at the step's batch size (spec_decode/switch.py; re-probed now
        and then), which turns drafting off at the batch sizes where it cannot pay; with `adaptive_k` (opt-in) it also
        picks how many drafts (<= k) each sequence asks for. Resets `spec_stats`.
        Raises TypeError for a non-BaseProposer, ValueError for a limit < 1, when a waiting prompt plus
        num_speculative_tokens lookahead slots no longer fits the KV cache, or for a proposer that reads
        hidden states or proposes trees under pipeline micro-batches."""
        if proposer is not None and not isinstance(proposer, BaseProposer):
            raise TypeError(f"proposer must be a BaseProposer or None, got {type(proposer).__name__}")
        if proposer is not None and self._batch_queue is not None and (
                proposer.needs_hidden_states or getattr(proposer, "proposes_trees", False)):
            raise ValueError(f"{type(proposer).__name__} reads the target's hidden states or proposes trees, which "
                             "pipeline micro-batches do not pass on; proposers that need only the tokens (ngram, "
                             "draft_model with its own checkpoint) are supported, or set pipeline_microbatching=False")
        if disable_by_batch_size is None and proposer is not None:
            disable_by_batch_size = proposer.default_disable_by_batch_size
        if disable_by_batch_size is not None and (isinstance(disable_by_batch_size, bool)
                                                  or not isinstance(disable_by_batch_size, int)
                                                  or disable_by_batch_size < 1):
            raise ValueError(f"disable_by_batch_size must be None or an integer >= 1, got {disable_by_batch_size!r}")
        self.scheduler.set_num_lookahead_tokens(0 if proposer is None else proposer.num_speculative_tokens)
        self.proposer = proposer
        self.spec_disable_by_batch_size = disable_by_batch_size
        self._over_batch_limit = False  # the last step was over it: no hidden states gathered (_hidden_state_rows)
        self.spec_switch = (SpecSwitch(proposer.num_speculative_tokens, decay=proposer.acceptance_decay)
                            if proposer is not None and adaptive else None)
        self.spec_adaptive_k = bool(adaptive_k)
        self.spec_stats = SpecDecodeStats()

    def _propose_drafts(self, in_step: list[str]) -> None:
        """Ask the proposer about every decode-ready sequence; hand its checked drafts to the scheduler.
        The decode-ready sequences are appended to `in_step`: a failure here fails their requests."""
        requests = []
        ready = self.scheduler.decode_ready_request_ids()
        switch, limit = self.spec_switch, self.spec_disable_by_batch_size
        may_draft = switch is None or switch.begin_step(ready, self._decode_only_step(ready))
        self._over_batch_limit = limit is not None and len(ready) > limit
        if self._over_batch_limit:
            self.spec_stats.num_steps_over_batch_limit += 1
            return
        in_step.extend(ready)
        trees = getattr(self.proposer, "proposes_trees", False)
        for sid in ready:
            st, seq = self.output_processor.seq(sid)
            # seeded sampled rows always draft: which steps verify drafts changes their random stream, and a
            # seed promises the same output run after run, whatever the timing the switch measures
            seeded = st.params.seed is not None and not st.params.is_greedy
            # adaptive k: the switch's number of drafts; seeded rows keep k (their random stream), trees their shape
            # ask None: the switch costs the sequence's recent drafts per verify (trees: their k nodes, as verified)
            k = self.proposer.num_speculative_tokens
            ask = k if trees else None
            if switch is not None and self.spec_adaptive_k and not seeded and not trees:
                k = ask = switch.num_drafts(sid, len(ready))
            if switch is not None and not seeded and not (may_draft and switch.wants_drafts(sid, len(ready), ask)):
                continue
            req = DraftRequest.for_sequence(sid, st.prompt_token_ids, seq.output_token_ids, st.params.max_tokens,
                                            self.max_model_len, k)
            if req is not None and not seq.finished:
                requests.append(req)
        if requests:
            if getattr(self.proposer, "proposes_trees", False):  # greedy rows (exact); sampled ones under typical
                typical = self.sampler.typical_acceptance is not None  # acceptance only (not lossless anyway)
                self.proposer.set_tree_seq_ids(r.seq_id for r in requests
                                               if typical or self.output_processor.seq(r.seq_id)[0].params.is_greedy)
            if switch is not None:
                self.proposer.set_draft_token_cost(switch.draft_token_cost(len(ready)))
            start = switch.clock() if switch is not None else 0.0
            proposals = self._call_proposer(requests)
            drafts = check_proposals(requests, proposals, self.proposer.num_speculative_tokens, self.vocab_size)
            for sid, tokens in drafts.items():
                self.scheduler.set_draft_tokens(sid, tokens)
            if switch is not None:
                switch.record_proposals(sum(map(len, drafts.values())), switch.clock() - start, len(requests))

    def _decode_only_step(self, ready: list[str]) -> bool:
        """Whether the coming step holds decode-ready rows only (none mid-prefill, no waiting request it can
        admit): its time is a clean sample of a decode or verify step for the switch. Never under pipeline
        micro-batches: the time between two schedules is not one step's there (the switch then leaves drafting on)."""
        if self._batch_queue is not None:
            return False
        running = self.scheduler.num_running
        return running == len(ready) and (self.scheduler.num_waiting == 0
                                          or running >= self.config.scheduler_config.max_num_seqs)

    def _hidden_state_rows(self, sched_out) -> list[int]:
        """The sampling rows whose final hidden states the proposer reads (none unless it needs_hidden_states, and
        none in a step over the batch limit: no drafts follow it, and gathering them made batch-8 Medusa steps ~1.4x
        slower, bench_spec_decode; a sequence whose batch falls back under the limit drafts from its next step's)."""
        if self.proposer is None or not self.proposer.needs_hidden_states or self._over_batch_limit:
            return []
        return [r for r, sampled in enumerate(sched_out.do_sample.tolist()) if sampled]

    def _observe_hidden_states(self, sched_out, seq_ids: list[str], rows: list[int], hidden,
                               update: StepUpdate) -> None:
        """Hand the proposer, per sequence that sampled and goes on, the hidden state whose logits gave its
        newest token: a plain row's last position, a spec row's last accepted one (the bonus token's
        logits row); a new child of n > 1 sampling gets its parent row's."""
        if not rows or hidden is None:
            return
        counts = sched_out.num_scheduled_tokens
        last_rows = getattr(self, "_tree_last_rows", {})  # tree rows: the accepted path's last node
        kept_by_seq = update.tokens_by_seq
        pick, start = {}, 0  # seq_id -> its row in `hidden` (the rows' positions, row after row)
        for r in rows:
            n = int(counts[r])
            sid = seq_ids[r]
            kept = kept_by_seq.get(sid)
            pick[sid] = start + (last_rows.get(sid, len(kept) - 1) if kept else n - 1)
            start += n
        for parent_id, child_id, _ in update.forks:
            if parent_id in pick:
                pick[child_id] = pick[parent_id]
        ids, lens, positions = [], [], []
        seq_of = self.output_processor.seq
        for sid, pos in pick.items():
            st, seq = seq_of(sid)
            if not seq.finished:
                ids.append(sid)
                lens.append(len(st.prompt_token_ids) + len(seq.output_token_ids))
                positions.append(pos)
        if len(ids) == 1:  # batch 1: a view of the runner's copy (each step's hidden_states is a new tensor)
            self.proposer.observe_hidden_states(ids, lens, hidden[positions[0] : positions[0] + 1])
        elif ids:
            index = torch.as_tensor(positions, dtype=torch.long)
            self.proposer.observe_hidden_states(ids, lens, gather_rows(hidden, index) if hidden.is_cpu
                                                else hidden[index.to(hidden.device)])

    def _draft_parents(self, sched_out, seq_ids: list[str]) -> np.ndarray | None:
        """Each scheduled draft's parent within its row (-1: the row's first token), flat like
        sched_out.draft_token_ids; None when every spec row is a chain (no tree this step). `_tree_pad_tokens`: the
        nodes the scheduler clamped off the step's trees when the proposer drafts prefixes of one tree (the model
        runner pads a replayed step back to the full trees' shape, tree_step.pad_tree_step)."""
        self._step_tree_parents, self._tree_pad_tokens = None, 0
        if self.proposer is None or not getattr(self.proposer, "proposes_trees", False):
            return None
        counts = sched_out.num_draft_tokens.tolist()  # Python ints: numpy calls are slow right after a forward
        rows = [r for r, k in enumerate(counts) if k]
        per_row = [self.proposer.draft_parents(seq_ids[r], counts[r]) for r in rows]
        if all(p is None for p in per_row):
            return None
        self._step_tree_parents = dict(zip(rows, per_row))
        full = getattr(self.proposer, "tree_num_nodes", None)
        if full is not None:
            self._tree_pad_tokens = sum(full - len(p) for p in per_row if p is not None)
        flat = [p for r, parents in zip(rows, per_row)
                for p in (parents if parents is not None else chain_parents(counts[r]))]
        return np.asarray(flat, dtype=np.int32)

    def _tree_paths(self, sched_out, split, spec_logits: torch.Tensor | None, rows,
                    target_ids: list[int] | None = None) -> TreePaths | None:
        """The path of every tree row (greedy; sampled rows: typical acceptance's; None: no tree this step).
        target_ids: the spec logits rows' argmax when the LM head gave it (every row plain greedy; no spec_logits)."""
        self._tree_last_rows = {}
        parents = getattr(self, "_step_tree_parents", None)
        if not parents:
            return None
        seq_ids = [sched_out.request_ids[r] for r in split.spec_rows]
        if target_ids is None:
            target_ids = argmax_rows(spec_logits).tolist()  # torch's argmax rule, without its slow CPU reduction
        row_parents = [parents.get(int(r)) for r in split.spec_rows]
        chosen = typical_tree_paths(split, row_parents, rows, spec_logits, self.sampler.typical_acceptance,
                                    self.vocab_size)  # {} when rows is None (every row plain greedy)
        return choose_tree_paths(split, row_parents, target_ids, seq_ids, chosen)

    def _commit_tree_paths(self, sched_out, seq_ids: list[str], paths: TreePaths, accepted: list[list[int]]) -> None:
        """Tree rows: move the accepted path's KV into the row's first lookahead slots, put its tokens first
        among the pending drafts (so update() commits them) and note which row position gave the bonus token."""
        qsl = sched_out.query_start_loc
        src, dst = [], []
        num_accepted = [len(tokens) - 1 for tokens in accepted]
        for r, path, a in zip(paths.chain_split.spec_rows, paths.paths, num_accepted):
            first = int(qsl[r]) + 1  # the row's first draft
            for j in range(a):
                if path[j] != j:
                    src.append(int(sched_out.slot_mapping[first + path[j]]))
                    dst.append(int(sched_out.slot_mapping[first + j]))
            self._tree_last_rows[seq_ids[r]] = 0 if a == 0 else 1 + path[a - 1]
        if src:
            self.executor.collective_rpc(move_kv_slots, args=(src, dst))
        self.scheduler.set_pending_draft_tokens(reordered_drafts(paths.original_split, paths.paths, num_accepted))

    def _call_proposer(self, requests: list[DraftRequest]) -> dict:
        """The proposer's answer; when it raises, no drafts this step (outputs do not depend on drafts):
        the error is counted in spec_stats.num_proposer_errors and logged in full the first time."""
        try:
            return self.proposer.propose(requests)
        except Exception as exc:  # noqa: BLE001 - a broken proposer costs speed, never requests
            stats = self.spec_stats
            stats.num_proposer_errors += 1
            if stats.num_proposer_errors == 1:
                logger.warning("proposer %s raised; steps with a failing proposer run without drafts",
                               type(self.proposer).__name__, exc_info=exc)
            return {}

    def _sample_and_verify(self, sched_out, seq_ids: list[str], logits: torch.Tensor,
                           live: list[bool] | None = None, target_ids: torch.Tensor | None = None) -> StepUpdate:
        """A step with spec rows: plain sampling rows are sampled as usual, spec rows verified; each spec
        row's accepted tokens are appended one by one with stop checks (a stop truncates the run). `live`
        (a step collected from the pipeline): per scheduler row, False for one aborted in flight (no token).
        `target_ids` (int64 [logits rows]): every sampling row is plain greedy and the LM head gave each logits row's
        argmax instead of the logits (the runner's greedy_token_ids): tokens and verification come from those."""
        split = split_spec_rows(sched_out)
        if live is not None:
            split = keep_rows(split, np.asarray(live, dtype=bool))
        if target_ids is not None:
            return self._verify_from_argmax(sched_out, seq_ids, split, target_ids.tolist())
        update = StepUpdate()
        if len(split.plain_rows):
            targets, rows, logit_rows = self._build_sampling_rows(seq_ids, split.plain_rows)
            token_ids, logprob_lists = self._sample(logits[split.plain_logit_rows], rows, logit_rows)
            update = self._apply_sampled_tokens(targets, token_ids, logprob_lists)
        seqs = [self.output_processor.seq(seq_ids[r]) for r in split.spec_rows]
        # every spec row plain greedy (RequestState.plain_greedy): the verify is argmax against drafts, so no
        # SamplingRow per target position and no per-row tensors (~0.4 ms of a batch-1 Medusa step, session 16)
        plain = all(st.plain_greedy for st, _ in seqs)
        rows = None if plain else [SamplingRow(st.params, st.prompt_token_ids, seq.output_token_ids,
                                               self._generator(seq.seq_id, st.params, seq.index)) for st, seq in seqs]
        spec_logits = _take_rows(logits, split.spec_logit_rows)
        paths = self._tree_paths(sched_out, split, spec_logits, rows)
        if paths is not None and plain:  # the argmax rows that chose the paths verify them too
            split, verified = paths.chain_split, verify_greedy_paths(paths)
        else:
            if paths is not None:  # verify each row's chosen path as a chain: its logits rows, its tokens
                # a view when each path is its tree's first nodes (the heaviest branch usually is)
                split, spec_logits = paths.chain_split, _take_rows(spec_logits, paths.chain_logit_rows)
            if plain:
                md = plain_greedy_metadata(sum(1 + len(d) for d in split.draft_token_ids), self.vocab_size)
            else:
                md = build_sampling_metadata(expand_rows_for_verify(rows, split.draft_token_ids), self.vocab_size,
                                             device=spec_logits.device)
            verified = self.sampler.verify(spec_logits, split.draft_token_ids, md)
        if paths is not None:
            self._commit_tree_paths(sched_out, seq_ids, paths, verified.accepted_token_ids)
        return self._append_verified(update, seqs, split, paths, verified)

    def _verify_from_argmax(self, sched_out, seq_ids: list[str], split, target_ids: list[int]) -> StepUpdate:
        """_sample_and_verify of a step whose sampling rows are all plain greedy, from each logits row's argmax: plain
        rows take theirs; spec rows (chains and trees) keep their path's drafts up to the first one the target's
        argmax before it disagrees with, then the target's token there (verify_greedy_paths: the sampler's greedy
        rule on the same argmax)."""
        update = StepUpdate()
        if len(split.plain_rows):
            targets, _, _ = self._build_sampling_rows(seq_ids, split.plain_rows)
            update = self._apply_sampled_tokens(targets, [target_ids[r] for r in split.plain_logit_rows.tolist()], None)
        seqs = [self.output_processor.seq(seq_ids[r]) for r in split.spec_rows]
        spec_ids = [target_ids[r] for r in split.spec_logit_rows.tolist()]
        paths = self._tree_paths(sched_out, split, None, None, spec_ids)
        if paths is not None:
            verified = verify_greedy_paths(paths)
            self._commit_tree_paths(sched_out, seq_ids, paths, verified.accepted_token_ids)
        else:  # every spec row a chain: each chain is its own path
            chains = choose_tree_paths(split, [None] * len(seqs), spec_ids, [seq.seq_id for _, seq in seqs])
            verified = verify_greedy_paths(chains)
        return self._append_verified(update, seqs, split, paths, verified)

    def _append_verified(self, update: StepUpdate, seqs: list, split, paths: TreePaths | None, verified) -> StepUpdate:
        """Append each spec row's accepted tokens (stop checks truncate a run) and record the statistics."""
        if paths is not None:
            split = paths.chain_split
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
            num_drafts = len(drafts) if paths is None else paths.depths[seq.seq_id]  # a tree counts its depth
            self.spec_stats.record(num_drafts, len(tokens) - 1, kept)
            if self.spec_switch is not None:
                self.spec_switch.record_verify(seq.seq_id, num_drafts, len(tokens) - 1)
            if st.metrics.spec_decode is None:
                st.metrics.spec_decode = SpecDecodeMetrics()
            st.metrics.spec_decode.record(num_drafts, len(tokens) - 1)
            start += len(drafts) + 1
        return update


SERIAL_GATHER_MAX_ROWS = 32  # up to this many rows, _take_rows copies row pieces serially
COPY_PIECE = 16384  # elements per piece: below torch's parallel grain (32768), so each copy_ stays on this thread


def _take_rows(logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
    """logits[rows] [len(rows), V]: a view when the rows are consecutive (batch 1, or every sampling row a spec row),
    else a copy. torch's gather of [1 + k, V] is an OpenMP region, which a loaded 2-core machine stalls for 15-20 ms
    (measured at load 14, vs 0.1 ms for these serial piecewise copies); many rows still go through the gather."""
    n = len(rows)
    if n and n <= SERIAL_GATHER_MAX_ROWS:  # a few rows: checked in Python (numpy calls cost ~10 us each here)
        first = int(rows[0])
        if np.asarray(rows).tolist() == list(range(first, first + n)):
            return logits[first : first + n]
    elif n and int(rows[-1]) - int(rows[0]) == n - 1 and bool((np.diff(rows) == 1).all()):
        return logits[int(rows[0]) : int(rows[0]) + n]
    if n > SERIAL_GATHER_MAX_ROWS or logits.device.type != "cpu" or not logits.is_contiguous():
        return logits[torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))]
    width = logits.shape[1]
    out = torch.empty((n, width), dtype=logits.dtype)
    flat_in, flat_out = logits.view(-1), out.view(-1)
    for i, r in enumerate(np.asarray(rows).tolist()):
        for c in range(0, width, COPY_PIECE):
            m = min(COPY_PIECE, width - c)
            flat_out.narrow(0, i * width + c, m).copy_(flat_in.narrow(0, r * width + c, m))
    return out
