"""`medusa`: Medusa heads (medusa_heads.py) draft a chain from the target's own last hidden state.

    LLM(model, speculative_config={"method": "medusa", "num_speculative_tokens": 3,
                                   "model": "/path/to/heads"})     # a `pagellm train-medusa` output

Drafts for a sequence whose last token x_{t+1} the target sampled from the hidden state h_t: the top-1
token of heads 1 .. k on h_t (head i guesses x_{t+1+i}), a chain the engine verifies like any other
drafts (lossless: greedy rows token-identical, sampled rows identically distributed; greedy drafts are
a deterministic function of the context, so the one-hot draft distribution is exact).

Hidden states. The proposer declares `needs_hidden_states`; the engine then asks the runner for the final
hidden states of every sampling row and hands the proposer, per sequence, the one whose logits gave the
sequence's newest token (a spec row: the last accepted position) with the sequence's length at that
point (`observe_hidden_states`). A sequence whose stored state is not for its current length (a new
child of n > 1 sampling, a preempted sequence being recomputed) gets no drafts that step. No KV cache,
no forward of its own: one [B*k, H] pass through the ResBlocks and the target's LM head per step.

Hydra heads (`pagellm train-medusa --head-type hydra`, hydra_heads.py; the same directory layout and option):
head i + 1 reads head i's draft, so the chain is drafted sequentially from the sequence's newest token, and a
tree's nodes are their parent's top-k guesses. The proposer reads the target's input embedding from its checkpoint.

Trees (`"tree": "default" | "mc_sim_7b_63" | [[0], [1], [0, 0], ...]`): `MedusaTreeProposer` gives greedy rows
the heads' top-k candidate tree, verified in one forward (medusa_tree.py, engine/tree_step.py). A target the tree
step cannot run (a quantized KV cache, sliding-window or MLA layers) is refused at construction.

Sampled rows: lossless rejection sampling by default; `"acceptance": "typical"` (+ `posterior_threshold`,
`posterior_alpha`) accepts by Medusa's typical acceptance instead, more drafts on high-entropy rows but NOT
lossless (sampling/typical.py). Greedy rows are exact either way.
"""

from __future__ import annotations

from os import PathLike
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from pagellm.attention.tree_verify import check_tree_verification
from pagellm.logger import init_logger
from pagellm.spec_decode.base import BaseProposer, DraftRequest
from pagellm.spec_decode.hydra_heads import HydraHeads, load_draft_heads, tree_plan
from pagellm.spec_decode.medusa_heads import (  # noqa: F401 (re-export)
    DraftVocabLMHead,
    MedusaHeads,
    base_model_hash,
    draft_vocab_lm_head,
)
from pagellm.spec_decode.medusa_tree import MedusaTree, tree_from_options
from pagellm.spec_decode.registry import ProposerContext, SpeculativeConfig, register_proposer
from pagellm.step_graph import StepGraphCache, iter_tensors

logger = init_logger(__name__)


@register_proposer("medusa")
class MedusaProposer(BaseProposer):
    """Top-1 chain drafts of Medusa heads. `lm_head`: the target's LM head ([M, H] -> [M, V]), used by
    heads that share it; `num_speculative_tokens` must not exceed the heads' count."""

    # tree: verify a candidate tree (medusa_tree.py) instead of a chain; warm_heads: warm_caches (off by default)
    OPTIONS = ("model", "tree", "warm_heads")
    needs_hidden_states = True
    # like ngram: scoring 1 + k tokens per row is nearly free while CPU decode is weight-bound
    default_disable_by_batch_size = 4
    # heads accept about as often from one step to the next (open chat: 0 drafts ~60 % of verifies, 1-3 the rest, a
    # mean of ~0.55): at the switch's default weight 0.3 a few unlucky verifies pushed the average under the cost and
    # the re-probe backoff kept drafting off for ~70 % of chat steps (session 16, bench_verify_profile: 1.00x with the
    # switch against 1.32x drafting every step); 0.03 averages over ~60 verifies and still turns off heads that do
    # not pay (the switch's tests)
    acceptance_decay = 0.03

    def __init__(self, num_speculative_tokens: int, heads: MedusaHeads,
                 lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__(num_speculative_tokens)
        if not isinstance(heads, MedusaHeads):
            raise TypeError(f"heads must be MedusaHeads, got {type(heads).__name__}")
        if num_speculative_tokens > heads.num_heads:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} exceeds the {heads.num_heads} "
                             "Medusa heads (one draft per head)")
        if heads.share_lm_head and lm_head is None:
            raise ValueError("these Medusa heads share the target's LM head: pass lm_head")
        self.heads = heads.eval()
        self.lm_head = lm_head
        # with a draft vocabulary, lm_head scores only its rows (draft_vocab_lm_head): indices map back to tokens
        self.draft_vocab = heads.draft_vocab if heads.share_lm_head else None
        self._dtype = next(heads.parameters()).dtype
        # seq_id -> (sequence length, hidden states [n, H] as handed over, the sequence's row in them)
        self._hidden: dict[str, tuple[int, torch.Tensor, int]] = {}
        # Hydra heads scoring a draft vocabulary draft from step graphs, one per (kind, batch size): None until the
        # first draft, False: drafting stays eager (other heads or LM heads, whose tensors the graphs would not know)
        self._graphs: StepGraphCache | None | bool = None if isinstance(heads, HydraHeads) and isinstance(
            lm_head, DraftVocabLMHead) else False
        self._warm_ranges: list[tuple[int, int]] = []  # (address, bytes) of what replayed drafting reads: warm_caches
        self.warm_heads = False  # speculative_config "warm_heads": warm_caches names _warm_ranges to the thread pool

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        model = options.get("model")
        if not isinstance(model, (str, PathLike)) or not str(model):
            raise ValueError("speculative_config: method 'medusa' needs model= the Medusa heads directory, "
                             f"got {model!r}")
        tree_from_options(options)
        if not isinstance(options.get("warm_heads", False), bool):
            raise ValueError(f"speculative_config: warm_heads must be true or false, got {options['warm_heads']!r}")

    @classmethod
    def from_config(cls, config: SpeculativeConfig, context: ProposerContext) -> "MedusaProposer":
        """Load the heads (ValueError for a missing directory, another hidden size or vocabulary, or
        num_speculative_tokens above the number of heads) and reach the target's LM head."""
        heads = load_draft_heads(config.options["model"], dtype=torch.float32)
        hf_config = context.model_files.hf_config
        heads.check_target(int(hf_config.hidden_size), int(context.vocab_size))
        if heads.base_model_hash not in (None, base_model_hash(hf_config)):
            logger.warning("Medusa heads %s were trained on another base model (%s); drafts may be poor",
                           config.options["model"], heads.base_model)
        if isinstance(heads, HydraHeads):
            heads.set_embedding(load_input_embedding(context.model_files))
        if heads.draft_vocab is not None:
            lm_head = draft_vocab_lm_head(load_lm_head_weight(context.model_files), heads.draft_vocab)
        else:
            lm_head = target_lm_head(context) if heads.share_lm_head else None
        tree = tree_from_options(config.options, heads.training_info.get("trees") or {})
        if tree is None:
            proposer = cls(config.num_speculative_tokens, heads, lm_head)
            proposer.warm_heads = bool(config.options.get("warm_heads", False))
            return proposer
        if tree.depth > config.num_speculative_tokens:
            raise ValueError(f"the Medusa tree is {tree.depth} deep: it needs num_speculative_tokens >= {tree.depth} "
                             f"(one head per level), got {config.num_speculative_tokens}")
        check_tree_verification(context.executor, "Medusa trees", "drop 'tree'")
        proposer = MedusaTreeProposer(heads, tree, lm_head)
        proposer.warm_heads = bool(config.options.get("warm_heads", False))
        return proposer

    # ------------------------------------------------------------------ the engine's hidden states
    def observe_hidden_states(self, seq_ids: Sequence[str], num_tokens: Sequence[int], hidden: torch.Tensor) -> None:
        """hidden [len(seq_ids), H]: row i is the final hidden state whose logits gave the newest token
        of seq_ids[i], which then had num_tokens[i] tokens (prompt + output). Kept as (tensor, row), unconverted:
        propose() reads the rows it drafts from in one gather (the engine hands over a copy, never a step buffer)."""
        hidden = hidden.detach()
        for i, (sid, n) in enumerate(zip(seq_ids, num_tokens)):
            self._hidden[sid] = (int(n), hidden, i)

    def hidden_state_of(self, seq_id: str) -> tuple[int, torch.Tensor] | None:
        """(sequence length, h [H]) last observed for a sequence (None: none)."""
        state = self._hidden.get(seq_id)
        return None if state is None else (state[0], state[1][state[2]].to(self._dtype))

    @property
    def num_tracked_seqs(self) -> int:
        return len(self._hidden)

    # ------------------------------------------------------------------ the proposer contract
    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        fresh = self._fresh(requests)
        if not fresh:
            return {}
        k = min(self.num_speculative_tokens, max(r.max_num_drafts for r, _ in fresh))
        tokens = self._draft_chain(self._stack(fresh), _last_ids(r for r, _ in fresh), k)
        return {r.seq_id: row[: r.max_num_drafts] for (r, _), row in zip(fresh, tokens.tolist())}

    def _draft_chain(self, hidden: torch.Tensor, last_ids: torch.Tensor, k: int) -> torch.Tensor:
        """[B, k] the heads' greedy chain (draft_chain), from a step graph when the heads allow it."""
        def draft(inputs: list[torch.Tensor]) -> torch.Tensor:
            return self.heads.draft_chain(inputs[0], inputs[1], self.lm_head, k, self._token_ids)

        return self._replay(("chain", hidden.shape[0], k), draft, [hidden, last_ids])

    def _replay(self, key: tuple, draft: Callable[[list[torch.Tensor]], torch.Tensor],
                inputs: list[torch.Tensor]) -> torch.Tensor:
        """draft(inputs), replayed from the step graph of `key` when the heads allow it: drafting is ~20-50 small
        torch calls whose Python and dispatcher code a served step meets cold, right after the target's forward
        streamed its weights through the caches (session 18: a 6-node Hydra tree 0.77-0.85 -> 0.42-0.45 ms after a
        300 MB sweep). The heads' parameters are fixed while serving (their bf16 drafting weights, made before the
        first capture, are the graphs' constants); the result is read at once (a replay reuses its buffers)."""
        if self._graphs is False:
            return draft(inputs)
        if self._graphs is None:
            self._warm_ranges = _drafting_ranges(self.heads, self.lm_head, self.draft_vocab)
            constants = [*iter_tensors(self.heads), *iter_tensors(self.lm_head)]
            if isinstance(self, MedusaTreeProposer):
                constants += iter_tensors(tree_plan(tuple(self.tree.parents), tuple(self.tree.ranks)))
            self._graphs = StepGraphCache(constants, max_graphs=8, capture_after=2)
        return self._graphs.run(key, [t.contiguous() for t in inputs], draft)

    def warm_caches(self) -> None:
        """Names the replayed drafting's weights (heads' bf16 products, the draft vocabulary's int8 rows: 8.7 MB for
        3 heads at H = 576) for the thread pool's idle workers to prefetch while the engine verifies the step: the
        target's forward has just streamed ~270 MB through a 32 MB L3, and drafting read them from memory (session 18:
        a Hydra tree's replay 0.33 ms warm, 0.8 ms served). Nothing on one thread. Off unless `warm_heads`: on the
        loaded 2-core EPYC of session 19 it did not measurably help and two of three 2-thread profiles ran slower
        (a worker kept busy is preempted more often while it holds a kernel's chunk; benchmarks/README.md)."""
        if self.warm_heads and self._warm_ranges:
            from pagellm import _C  # noqa: PLC0415

            _C.warm_ranges(self._warm_ranges)

    def _token_ids(self, indices: torch.Tensor) -> torch.Tensor:
        """Indices into the heads' logits -> token ids (the same unless a draft vocabulary is scored)."""
        return indices if self.draft_vocab is None else self.draft_vocab[indices]

    def release(self, seq_ids: Iterable[str]) -> None:
        for sid in seq_ids:
            self._hidden.pop(sid, None)

    def _fresh(self, requests: Sequence[DraftRequest]) -> list[tuple[DraftRequest, tuple[torch.Tensor, int]]]:
        """The requests whose stored hidden state is for their current length, with it ((tensor, row))."""
        fresh = []
        hidden = self._hidden
        for r in requests:
            state = hidden.get(r.seq_id)
            if state is not None and state[0] == len(r.prompt_token_ids) + len(r.output_token_ids):
                fresh.append((r, state[1:]))
        return fresh

    def _stack(self, fresh: Sequence[tuple[DraftRequest, tuple[torch.Tensor, int]]]) -> torch.Tensor:
        """[len(fresh), H] the requests' hidden states in the heads' dtype: a slice when they are consecutive rows of
        one handed-over tensor (always at batch 1), else one gather."""
        first, row0 = fresh[0][1]
        if all(t is first and i == row0 + n for n, (_, (t, i)) in enumerate(fresh)):
            hidden = first[row0 : row0 + len(fresh)]
        else:
            hidden = torch.stack([t[i] for _, (t, i) in fresh])
        if self._graphs is not False and self._dtype == torch.float32:
            # Hydra drafting (the replayed kind) starts with hidden.float(), inside its step graph: the same bits as a
            # conversion here, without a torch call run cold after the forward (~0.04 ms at batch 1, session 19)
            return hidden
        return hidden.to(self._dtype)


class MedusaTreeProposer(MedusaProposer):
    """Tree drafts for the rows the engine allows (greedy ones; sampled ones too under typical acceptance), top-1
    chains for the others. `num_speculative_tokens` (the lookahead slots
    a row reserves) is the tree's node count; `tree.depth` heads are used and must exist."""

    proposes_trees = True  # the engine asks draft_parents() and tells set_tree_seq_ids() which rows may take trees

    def __init__(self, heads: MedusaHeads, tree: MedusaTree,
                 lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        if not isinstance(tree, MedusaTree):
            raise TypeError(f"tree must be a MedusaTree (MedusaTree.from_spec), got {type(tree).__name__}")
        super().__init__(tree.depth, heads, lm_head)  # ValueError when the heads are fewer than the tree's depth
        self.tree = tree
        self.num_speculative_tokens = max(tree.num_nodes, tree.depth)
        self._tree_ok: set[str] = set()  # sequences that may take a tree this step
        self._tree_rows: set[str] = set()  # sequences whose last drafts were a tree

    @property
    def tree_num_nodes(self) -> int:
        """Every tree this proposer drafts is a prefix of one tree of this many nodes (the scheduler clamps a request's
        last drafts): the engine pads a step of clamped trees back to the full trees' shape, whose step graph then
        replays (engine/tree_step.py pad_tree_step)."""
        return self.tree.num_nodes

    def set_tree_seq_ids(self, seq_ids: Iterable[str]) -> None:
        """The sequences of the next propose() that may take a tree; the others get chains."""
        self._tree_ok = set(seq_ids)

    def draft_parents(self, seq_id: str, num_drafts: int) -> list[int] | None:
        """Parent index of each of the first num_drafts drafts of seq_id (-1: the row's committed token), or
        None when they are a chain."""
        if seq_id not in self._tree_rows:
            return None
        return list(self.tree.parents[:num_drafts])

    def _draft_tree(self, hidden: torch.Tensor, last_ids: torch.Tensor) -> torch.Tensor:
        """The tree's tokens [B, num_nodes] (HydraHeads.draft_tree), from a step graph when the heads allow it."""
        def draft(inputs: list[torch.Tensor]) -> torch.Tensor:
            return self.heads.draft_tree(inputs[0], inputs[1], self.tree.parents, self.tree.ranks, self.lm_head,
                                         self._token_ids)

        return self._replay(("tree", hidden.shape[0]), draft, [hidden, last_ids])

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        fresh = self._fresh(requests)
        self._tree_rows = set()
        if not fresh:
            return {}
        out = {}
        trees = [(r, h) for r, h in fresh if r.seq_id in self._tree_ok]
        chains = [(r, h) for r, h in fresh if r.seq_id not in self._tree_ok]
        if trees:
            nodes = self._draft_tree(self._stack(trees), _last_ids(r for r, _ in trees))
            for (r, _), row in zip(trees, nodes.tolist()):
                self._tree_rows.add(r.seq_id)
                out[r.seq_id] = row[: r.max_num_drafts]
        if chains:
            tokens = self._draft_chain(self._stack(chains), _last_ids(r for r, _ in chains), self.tree.depth)
            out.update({r.seq_id: row[: r.max_num_drafts] for (r, _), row in zip(chains, tokens.tolist())})
        return out


def _drafting_ranges(heads: HydraHeads, lm_head: DraftVocabLMHead,
                     draft_vocab: torch.Tensor | None) -> list[tuple[int, int]]:
    """(address, bytes) of every tensor Hydra drafting reads whole, in its order: head 0's products, the draft
    vocabulary's rows and scales, the other heads, the draft vocabulary's token ids. Makes the drafting weights."""
    per_head = heads.drafting_weights()
    tensors = [*per_head[0], lm_head.qweight, lm_head.scale, *(t for ts in per_head[1:] for t in ts)]
    if draft_vocab is not None:
        tensors.append(draft_vocab)
    return [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors
            if t.is_contiguous() and t.device.type == "cpu"]


def _last_ids(requests: Iterable[DraftRequest]) -> torch.Tensor:
    """[B] each sequence's newest token (the one its stored hidden state gave; Hydra heads start from it)."""
    return torch.tensor([r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1] for r in requests],
                        dtype=torch.long)


def _target_model(worker):
    return worker.model, worker.dtype


def target_lm_head(context: ProposerContext) -> Callable[[torch.Tensor], torch.Tensor]:
    """The target's LM head as a function [M, H] fp32 -> [M, V] fp32: the target's own module when its
    worker runs in this process (any weight format), else the checkpoint's lm_head (or tied embedding)."""
    model = None
    if context.executor is not None:
        try:
            models = context.executor.collective_rpc(_target_model)
            model, dtype = models[0] if len(models) == 1 else (None, None)
        except Exception as e:  # noqa: BLE001 - an out-of-process executor: read the checkpoint
            logger.info("medusa: target model not reachable in process (%s); loading its LM head", e)
    if model is not None and hasattr(model, "compute_logits"):  # the activations' dtype, whatever the weights'
        return lambda x: model.compute_logits(x.to(dtype)).float()
    weight = load_lm_head_weight(context.model_files)
    return lambda x: x @ weight.t()


def load_input_embedding(model_files) -> torch.Tensor:
    """[V, H] fp32 input embedding of a checkpoint (Hydra heads read it). ValueError when absent."""
    from pagellm.model_loader.files import iter_weights  # noqa: PLC0415

    for name, t in iter_weights(model_files):
        if name == "model.embed_tokens.weight" and t.is_floating_point():
            return t.float()
    raise ValueError(f"Hydra heads need a floating-point model.embed_tokens.weight; none in {model_files.path}")


def load_lm_head_weight(model_files) -> torch.Tensor:
    """[V, H] fp32 LM head of a checkpoint (its input embedding when tied). ValueError when absent."""
    from pagellm.model_loader.files import iter_weights  # noqa: PLC0415

    tied = bool(getattr(model_files.hf_config, "tie_word_embeddings", False))
    wanted = ("model.embed_tokens.weight",) if tied else ("lm_head.weight", "model.embed_tokens.weight")
    found = {name: t for name, t in iter_weights(model_files) if name in wanted}
    for name in wanted:
        if name in found and found[name].is_floating_point():
            return found[name].float()
    raise ValueError(f"no floating-point LM head ({' or '.join(wanted)}) in {model_files.path}")
