"""The `ngram` method (prompt lookup decoding): drafts copied from earlier in the sequence itself.

    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_min": 1, "prompt_lookup_max": 4})

For each sequence (prompt + output so far) the longest suffix of n tokens, n from prompt_lookup_max
down to prompt_lookup_min, that also occurred earlier is looked up (the most recent occurrence on a tie); the
tokens that followed it are the drafts (read on from their start when they reach the end of the sequence: a loop
goes on). No model: it pays off where outputs copy their input (rewriting, summarising, code edits).

Per-request draft length (`"draft_length": "match"`, the default): a sequence drafts as many tokens as its match
has agreed with the text, at most num_speculative_tokens: a 1-2 token coincidence drafts 1-2 tokens, a copy run
that has agreed for 20 tokens drafts k (the match is followed as the text keeps agreeing with it, so its length
grows past prompt_lookup_max), no match drafts nothing. k can then be set high (8-12) for copy-heavy work without
paying k rows per verify where matches are short. `"fixed"`: always k drafts after a match (the old rule).
`"cost"`: the number of drafts (<= k) with the most expected tokens per unit of step time (ngram_policy.py): each
match's chance of agreeing on, learnt per agreed length from the proposer's own followed matches, against a draft
token's verify cost relative to a plain step, which the engine measures (SpecSwitch) and hands over each step
(`set_draft_token_cost`) unless `"draft_token_cost"` pins it; until measured, DEFAULT_DRAFT_TOKEN_COST. Long drafts
where a copy has held, one or two after a coincidence, none where even one does not pay.
Matching is incremental (ngram_index.py): each sequence's tokens are indexed once as they are accepted, and a step
costs the newly accepted tokens plus one lookup among the earlier occurrences of the last token, not a scan of the
sequence (which made long sequences quadratic).

Candidate trees (`"tree_nodes": N`, N >= num_speculative_tokens): greedy rows get a token tree of up to N
nodes and depth num_speculative_tokens merged from several earlier occurrences of the suffix, heaviest
branches first (ngram_match.ngram_candidate_tree), verified in one step with paged_tree_attention like Medusa
trees (engine/tree_step.py); the longest path the target agrees with is committed. Sampled rows keep the
chain (lossless rejection sampling needs one deterministic draft path). A row whose tree is a single chain is
verified as one. A target the tree step cannot run (quantized KV cache, sliding-window or MLA layers) is
refused at construction.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from pagellm.attention.tree_verify import check_tree_verification
from pagellm.spec_decode.base import MAX_SPECULATIVE_TOKENS, BaseProposer, DraftRequest
from pagellm.spec_decode.ngram_index import MatcherCache
from pagellm.spec_decode.ngram_match import find_ngram_continuation, ngram_candidate_tree
from pagellm.spec_decode.ngram_policy import ContinuationStats, best_draft_length
from pagellm.spec_decode.registry import ProposerContext, SpeculativeConfig, register_proposer

MAX_PROMPT_LOOKUP = 128  # longest n-gram matched; longer suffixes add nothing a 128-token match lacks
DRAFT_LENGTHS = ("match", "fixed", "cost")
# "cost" before the engine measured a verify: a draft token costs this share of a plain step's row (session 14 measured
# 0.05-0.08 at one thread on the default model, batch 1)
DEFAULT_DRAFT_TOKEN_COST = 0.08
COST_MEASURE_LEN = 64  # "cost": a new match's agreement is measured up to this many tokens (its estimate's key)


@register_proposer("ngram")
class NgramProposer(BaseProposer):
    """Prompt-lookup drafts per sequence (incremental matchers, ngram_index.py), as many as the match has agreed
    (`draft_length` "match") or always k ("fixed"); sequences without a match get none."""

    OPTIONS = ("prompt_lookup_min", "prompt_lookup_max", "tree_nodes", "draft_length", "draft_token_cost")
    # CPU decode is weight-bound at small batches, so scoring 1 + k tokens per row is nearly free there;
    # from a handful of rows on the forward turns compute-bound and rejected drafts cost real time.
    default_disable_by_batch_size = 4

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4,
                 draft_length: str = "match", draft_token_cost: float | None = None) -> None:
        super().__init__(num_speculative_tokens)
        self.check_options({"prompt_lookup_min": prompt_lookup_min, "prompt_lookup_max": prompt_lookup_max,
                            "draft_length": draft_length, "draft_token_cost": draft_token_cost})
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.draft_length = draft_length
        self.pinned_draft_token_cost = draft_token_cost  # None: the engine's measurement (set_draft_token_cost)
        self.draft_token_cost = DEFAULT_DRAFT_TOKEN_COST if draft_token_cost is None else float(draft_token_cost)
        self.continuation_stats = ContinuationStats() if draft_length == "cost" else None
        self._matchers = MatcherCache(self.continuation_stats)

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        lo, hi = options.get("prompt_lookup_min", 1), options.get("prompt_lookup_max", 4)
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PROMPT_LOOKUP:
                raise ValueError(f"speculative_config: {name} must be an integer in [1, {MAX_PROMPT_LOOKUP}], "
                                 f"got {value!r}")
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        length = options.get("draft_length", "match")
        if not isinstance(length, str) or length not in DRAFT_LENGTHS:
            raise ValueError(f"speculative_config: draft_length must be one of {list(DRAFT_LENGTHS)}, got {length!r}")
        cost = options.get("draft_token_cost")
        if cost is not None and (isinstance(cost, bool) or not isinstance(cost, (int, float))
                                 or not 0.0 < cost <= 1.0):
            raise ValueError(f"speculative_config: draft_token_cost must be None (measured) or a number in (0, 1] "
                             f"(a draft token's verify cost relative to a plain step's row), got {cost!r}")
        if cost is not None and length != "cost":
            raise ValueError(f"speculative_config: draft_token_cost needs draft_length 'cost', got {length!r}")
        nodes = options.get("tree_nodes")
        if nodes is not None and (isinstance(nodes, bool) or not isinstance(nodes, int)
                                  or not 1 <= nodes <= MAX_SPECULATIVE_TOKENS):
            raise ValueError(f"speculative_config: tree_nodes must be None or an integer in [1, "
                             f"{MAX_SPECULATIVE_TOKENS}] (and >= num_speculative_tokens), got {nodes!r}")

    @classmethod
    def from_config(cls, config: SpeculativeConfig, context: ProposerContext) -> "NgramProposer":
        options = {k: v for k, v in config.options.items() if k in cls.OPTIONS}
        nodes = options.pop("tree_nodes", None)
        if nodes is None:
            return cls(config.num_speculative_tokens, **options)
        proposer = NgramTreeProposer(config.num_speculative_tokens, nodes, **options)  # ValueError: N < k
        check_tree_verification(context.executor, "ngram trees", "drop 'tree_nodes'")
        return proposer

    def set_draft_token_cost(self, cost: float | None) -> None:
        """The engine's latest measure of a draft token's verify cost relative to a plain step's row (None: not
        measured yet); "cost" draft lengths follow it unless draft_token_cost pinned one."""
        if self.pinned_draft_token_cost is None and cost is not None:
            self.draft_token_cost = cost

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        drafts: dict[str, list[int]] = {}
        mode, lo, hi = self.draft_length, self.prompt_lookup_min, self.prompt_lookup_max
        for r in requests:
            m = self._matchers.matcher(r.seq_id, r.prompt_token_ids, r.output_token_ids)
            room = min(self.num_speculative_tokens, r.max_num_drafts)
            if mode == "cost":
                end, agreed = m.find(lo, hi, COST_MEASURE_LEN)
                num = best_draft_length(self.continuation_stats, agreed, room, self.draft_token_cost)
            else:
                end, agreed = m.find(lo, hi, 0 if mode == "fixed" else r.max_num_drafts)
                num = room if mode == "fixed" else min(room, agreed)
            if end >= 0 and num > 0:
                drafts[r.seq_id] = m.continuation(end, num).tolist()
        return drafts

    def release(self, seq_ids: Iterable[str]) -> None:
        self._matchers.release(seq_ids)


class NgramTreeProposer(NgramProposer):
    """Candidate trees (ngram_match.ngram_candidate_tree) of depth `num_speculative_tokens` and at most
    `tree_nodes` nodes for the rows the engine allows (greedy ones), chains for the others. Its
    `num_speculative_tokens` (the lookahead slots a row reserves) becomes `tree_nodes`; `depth` keeps k."""

    proposes_trees = True  # the engine asks draft_parents() and tells set_tree_seq_ids() which rows may take trees

    def __init__(self, num_speculative_tokens: int, tree_nodes: int, prompt_lookup_min: int = 1,
                 prompt_lookup_max: int = 4, draft_length: str = "fixed", draft_token_cost: float | None = None) -> None:
        super().__init__(num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, draft_length, draft_token_cost)
        self.check_options({"tree_nodes": tree_nodes})
        if tree_nodes < num_speculative_tokens:
            raise ValueError(f"speculative_config: tree_nodes ({tree_nodes}) must be >= num_speculative_tokens "
                             f"({num_speculative_tokens}), the tree's depth")
        self.depth = num_speculative_tokens
        self.tree_nodes = tree_nodes
        self.num_speculative_tokens = tree_nodes
        self._tree_ok: set[str] = set()  # sequences that may take a tree in the next propose()
        self._parents: dict[str, list[int]] = {}  # sequences whose last drafts were a (branching) tree

    def set_tree_seq_ids(self, seq_ids: Iterable[str]) -> None:
        """The sequences of the next propose() that may take a tree; the others get chains."""
        self._tree_ok = set(seq_ids)

    def draft_parents(self, seq_id: str, num_drafts: int) -> list[int] | None:
        """Parent index of each of the first num_drafts drafts of seq_id (-1: the row's committed token), or
        None when they are a chain."""
        parents = self._parents.get(seq_id)
        if parents is None:
            return None
        parents = parents[:num_drafts]
        return None if parents == list(range(-1, len(parents) - 1)) else parents  # a clamped tree may be a chain

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        drafts: dict[str, list[int]] = {}
        self._parents = {}
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for r in requests:
            ids = np.asarray(r.token_ids, dtype=np.int64)
            depth = min(self.depth, r.max_num_drafts)
            if r.seq_id in self._tree_ok:
                tokens, parents = ngram_candidate_tree(ids, lo, hi, depth, min(self.tree_nodes, r.max_num_drafts))
                if parents != list(range(-1, len(parents) - 1)):  # a branching tree (a chain is verified as one)
                    self._parents[r.seq_id] = parents
            else:
                tokens = find_ngram_continuation(ids, lo, hi, depth).tolist()
            if tokens:
                drafts[r.seq_id] = tokens
        return drafts
