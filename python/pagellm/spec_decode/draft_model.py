"""`draft_model`: a smaller model with the target's tokenizer drafts k tokens greedily.

    LLM(target, speculative_config={"method": "draft_model", "num_speculative_tokens": 4,
                                    "model": "/models/small"})            # any HF directory or .gguf
    LLM(target, speculative_config={"method": "draft_model", "num_speculative_tokens": 3,
                                    "num_layers": 2})                     # self-draft: the target's first 2 layers

Options: draft_loading.DraftOptions. The draft keeps its own paged KV cache (draft_runner.DraftRunner)
and, per sequence, which tokens that cache holds. Each `propose()`:
  1. sync: the committed tokens are compared with the cached ones; cached drafts the target rejected are
     dropped (`BlockManager.shrink`), a new sequence gets blocks (prefix-cache hits count as computed); a draft with
     the target's KV layout copies the target's KV of a long run of uncached committed tokens (a new prompt) rather
     than computing it (`reuse_target_kv`, draft_kv_reuse.py);
  2. catch up: every uncached committed token is computed, in chunks of at most max_num_batched_tokens
     tokens per forward; the last one's logits give the first draft;
  3. k - 1 decode steps batched over all sequences, each feeding the previous draft.
The KV of drafts 1 .. k-1 stays cached: when the target accepts them, the next call starts after them.

Drafts are greedy, so they are a deterministic function of the context: the verifier's one-hot draft
distribution is then the draft's true distribution, and rejection sampling keeps sampled rows exact.

A sequence that does not fit the draft's cache (after evicting idle ones) gets no drafts this step.
Blocks are freed by `release()` (the engine calls it for finished / aborted sequences) and for
sequences that no call has asked about for FREE_AFTER_IDLE_CALLS calls (preempted ones).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from pagellm.spec_decode.base import BaseProposer, DraftRequest
from pagellm.spec_decode.draft_kv_reuse import MIN_REUSED_TOKENS
from pagellm.spec_decode.draft_loading import DRAFT_OPTIONS, DraftOptions
from pagellm.spec_decode.registry import ProposerContext, SpeculativeConfig, register_proposer

FREE_AFTER_IDLE_CALLS = 8  # a sequence absent this many propose() calls in a row loses its draft KV


@dataclass
class _SeqState:
    token_ids: list[int]  # what the draft cache holds, position by position: committed tokens, then drafts
    num_committed: int  # leading token_ids known to be the sequence's committed tokens
    last_call: int = 0  # the last propose() call that asked about the sequence


@dataclass
class _Plan:
    seq_id: str
    token_ids: list[int]  # committed tokens
    start: int  # first position to compute (the cache holds token_ids[:start])
    num_drafts: int
    drafts: list[int] = field(default_factory=list)


def _common_prefix(a: Sequence[int], b: Sequence[int], start: int) -> int:
    n = min(len(a), len(b))
    i = start
    while i < n and a[i] == b[i]:
        i += 1
    return i


@register_proposer("draft_model")
class DraftModelProposer(BaseProposer):
    """Greedy drafts from a draft model (an external checkpoint or a truncated self-draft)."""

    OPTIONS = DRAFT_OPTIONS
    # k draft steps cost k small forwards per step whatever the batch; at batch 8 on 2 cores a Q4_1 self-draft
    # was 0.56-0.69x no speculation (benchmarks/results/spec_decode_cpu2-session7.md): off above 4 sequences
    default_disable_by_batch_size = 4

    def __init__(self, num_speculative_tokens: int, runner, max_num_batched_tokens: int, target_kv=None) -> None:
        super().__init__(num_speculative_tokens)
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.runner = runner  # DraftRunner
        self.max_num_batched_tokens = max_num_batched_tokens
        self.target_kv = target_kv  # draft_kv_reuse.TargetKV: committed tokens' KV copied from the target (or None)
        self.num_reused_tokens = 0  # committed tokens whose KV came from the target (stats, tests)
        self._seqs: dict[str, _SeqState] = {}
        self._num_calls = 0

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        DraftOptions.from_options(options)

    @classmethod
    def from_config(cls, config: SpeculativeConfig, context: ProposerContext) -> "DraftModelProposer":
        """Build the draft (draft_loading.build_draft_model: ValueError for a missing path, another
        vocabulary or tokenizer, num_layers out of range) and its KV cache on the target's device."""
        from pagellm.spec_decode.draft_kv_reuse import target_kv_for  # noqa: PLC0415
        from pagellm.spec_decode.draft_loading import build_draft_model  # noqa: PLC0415
        from pagellm.spec_decode.draft_runner import DraftRunner  # noqa: PLC0415

        opts = DraftOptions.from_options(config.options)
        ec = context.engine_config
        mc, cc, sc = ec.model_config, ec.cache_config, ec.scheduler_config
        model, dtype = build_draft_model(opts, context)
        kv_dtype = dtype if cc.kv_cache_dtype == "auto" else cc.kv_cache_dtype
        num_blocks = opts.num_kv_blocks
        if num_blocks is None:
            num_blocks = _default_num_blocks(model, kv_dtype, context)
        runner = DraftRunner(model, device=mc.device, block_size=cc.block_size, num_blocks=num_blocks,
                             kv_cache_dtype=kv_dtype, max_model_len=sc.max_model_len, max_num_seqs=sc.max_num_seqs,
                             enable_prefix_caching=cc.enable_prefix_caching,
                             attention_backend=mc.attention_backend, enforce_eager=mc.enforce_eager)
        target_kv = target_kv_for(runner.kv_caches, context.executor, context.target_block_table,
                                  cc.block_size) if opts.reuse_target_kv else None
        return cls(config.num_speculative_tokens, runner, sc.max_num_batched_tokens, target_kv)

    # ------------------------------------------------------------------ the proposer contract
    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        self._num_calls += 1
        active = {r.seq_id for r in requests}
        self._free_idle(active)
        plans = [p for p in (self._prepare(r, active) for r in requests) if p is not None]
        if not plans:
            return {}
        try:
            self._catch_up(plans)
            self._decode(plans)
        except BaseException:
            self.release(p.seq_id for p in plans)  # their cache contents are unknown now
            raise
        bm = self.runner.block_manager
        for p in plans:
            st = self._seqs[p.seq_id]
            st.token_ids = p.token_ids + p.drafts[:-1]  # the last draft was never fed back
            st.num_committed = len(p.token_ids)
            bm.cache_full_blocks(p.seq_id, p.token_ids, len(p.token_ids))  # committed blocks only
        return {p.seq_id: p.drafts for p in plans}

    def release(self, seq_ids: Iterable[str]) -> None:
        """Free the draft blocks of sequences that are gone (finished, aborted); unknown ids are ignored."""
        for sid in seq_ids:
            if self._seqs.pop(sid, None) is not None:
                self.runner.block_manager.free(sid)

    def reset_prefix_cache(self) -> None:
        """Drop the draft's cached prefix hashes, as the target's are dropped (blocks in use stay allocated)."""
        self.runner.block_manager.reset_prefix_cache()

    def reset_state(self) -> None:
        """Forget every cached draft position and captured step (after the weights or the cache changed
        underneath, e.g. an in-place weight update of a self-draft's shared modules)."""
        self.release(list(self._seqs))
        self.runner.block_manager.reset_prefix_cache()
        self.runner.runner.invalidate_step_graphs()

    def sleep(self, level: int) -> int:
        """Free the draft's own KV cache (level 2: its weights too) while the engine sleeps (engine/maintenance.py);
        every cached position is forgotten first. Returns the measured bytes freed."""
        self.reset_state()
        return self.runner.sleep(level)

    def wake_up(self) -> None:
        """Restore what sleep freed; a no-op when awake."""
        self.runner.wake_up()

    @property
    def num_tracked_seqs(self) -> int:
        return len(self._seqs)

    # ------------------------------------------------------------------ per-sequence cache state
    def _prepare(self, req: DraftRequest, active: set[str]) -> _Plan | None:
        """Roll the sequence's draft cache back to what still matches its committed tokens and reserve
        slots for the rest plus the drafts fed back; None when the draft cache has no room for it."""
        sid, tokens = req.seq_id, req.token_ids
        num_drafts = min(req.max_num_drafts, self.num_speculative_tokens)
        bm = self.runner.block_manager
        st = self._seqs.get(sid)
        if st is not None and tokens[: st.num_committed] != st.token_ids[: st.num_committed]:
            self.release([sid])  # another sequence under a reused id
            st = None
        if st is None:
            hit = self._with_room(lambda: bm.allocate(sid, tokens, -1, num_drafts - 1), active)
            if hit is None:
                return None
            st = self._seqs[sid] = _SeqState(tokens[:hit], hit)
        # at least the last committed token is computed: its logits give the first draft
        start = min(_common_prefix(st.token_ids, tokens, st.num_committed), len(tokens) - 1)
        st.last_call = self._num_calls
        if start < len(st.token_ids):
            bm.shrink(sid, start)
            del st.token_ids[start:]
            st.num_committed = min(st.num_committed, start)
        if not self._with_room(lambda: bm.append_slots(sid, start, len(tokens) - start, num_drafts - 1), active):
            return None
        return _Plan(sid, tokens, self._reuse_target_kv(sid, start, len(tokens) - 1), num_drafts)

    def _reuse_target_kv(self, seq_id: str, start: int, end: int) -> int:
        """Where the draft's own computing starts: `start`, or `end` once the target's KV of [start, end) (committed
        tokens, which the target holds) is copied in; the last committed token is always computed (its logits give
        the first draft)."""
        if self.target_kv is None or end - start < MIN_REUSED_TOKENS:
            return start
        table = self.runner.block_manager.get_block_table(seq_id)
        if not self.target_kv.copy_into(self.runner.kv_caches, seq_id, table, start, end):
            return start
        self.num_reused_tokens += end - start
        return end

    def _with_room(self, allocate, active: set[str]):
        """allocate() (None / False: no room); on no room, evict every idle sequence and try once more."""
        result = allocate()
        if result is None or result is False:
            idle = [sid for sid in self._seqs if sid not in active]
            if idle:
                self.release(idle)
                result = allocate()
        return None if result is False else result

    def _free_idle(self, active: set[str]) -> None:
        for sid in [s for s in active if s in self._seqs]:
            self._seqs[sid].last_call = self._num_calls
        stale = [sid for sid, st in self._seqs.items() if self._num_calls - st.last_call >= FREE_AFTER_IDLE_CALLS]
        self.release(stale)

    # ------------------------------------------------------------------ the draft forwards
    def _catch_up(self, plans: list[_Plan]) -> None:
        """Compute every plan's uncached committed tokens (at most max_num_batched_tokens per forward);
        the greedy token after a plan's last one is its first draft."""
        from pagellm.spec_decode.draft_runner import DraftRow  # noqa: PLC0415

        cursor = {p.seq_id: p.start for p in plans}
        pending = plans
        while pending:
            budget, rows, still = self.max_num_batched_tokens, [], []
            for p in pending:
                pos = cursor[p.seq_id]
                n = min(len(p.token_ids) - pos, budget)
                if n > 0:
                    done = pos + n == len(p.token_ids)
                    rows.append(DraftRow(p.seq_id, p.token_ids[pos : pos + n], pos, done))
                    budget -= n
                    cursor[p.seq_id] = pos + n
                if cursor[p.seq_id] < len(p.token_ids):
                    still.append(p)
            nxt = self.runner.forward(rows)
            for p in pending:
                if p.seq_id in nxt:
                    p.drafts.append(nxt[p.seq_id])
            pending = still

    def _decode(self, plans: list[_Plan]) -> None:
        """Drafts 2 .. num_drafts: one batched decode step each, feeding the previous draft."""
        from pagellm.spec_decode.draft_runner import DraftRow  # noqa: PLC0415

        for j in range(1, self.num_speculative_tokens):
            rows = [DraftRow(p.seq_id, p.drafts[-1:], len(p.token_ids) + j - 1, True)
                    for p in plans if p.num_drafts > j]
            if not rows:
                return
            nxt = self.runner.forward(rows)
            for p in plans:
                if p.seq_id in nxt:
                    p.drafts.append(nxt[p.seq_id])


def _default_num_blocks(model, kv_dtype, context: ProposerContext) -> int:
    """As many blocks as the target's cache (the draft holds the same sequences, plus k - 1 drafts each,
    which the target's lookahead slots cover too), fewer when the memory left does not hold them."""
    from pagellm.kv_cache import determine_num_blocks, group_kv_cache_specs  # noqa: PLC0415

    ec = context.engine_config
    mc, cc, sc = ec.model_config, ec.cache_config, ec.scheduler_config
    target_blocks = getattr(context.executor, "num_kv_blocks", None)
    groups = group_kv_cache_specs(model.kv_cache_specs(cc.block_size, kv_dtype))
    fitting = determine_num_blocks(groups, mc.device, sc.max_model_len, sc.max_num_seqs, None, cc.kv_cache_fraction)
    return fitting if target_blocks is None else min(int(target_blocks), fitting)
