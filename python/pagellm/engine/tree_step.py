"""Tree verification of speculative drafts (Medusa trees, spec_decode/medusa_tree.py), shared by the engine
(which path to commit) and the model runner (how to run a step whose spec rows carry trees).

A spec row's drafts are tree nodes in an order where parents come first; `parents[j]` is draft j's parent
(-1: the row's first token, the last committed one). The row is run as one tree: its first token is the
root, draft j sits in the row's lookahead slot j (cache position L + j) but has the rotary position
L + depth(j), and attends to the committed context plus its ancestors (`paged_tree_attention`). A chain is
the tree parents = [-1, 0, 1, ...]; ordinary prefill chunks are chains too, so one tree mask covers the
whole prefill section of the batch. After verification the accepted path's KV moves to the row's first
slots (`move_kv_slots`), so the cache looks as if the path had been decoded token by token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch

from pagellm import ops
from pagellm.ops.tree import tree_depths, tree_mask_from_parents
from pagellm.sampling import SamplingRow, build_sampling_metadata, expand_rows_for_verify
from pagellm.sampling.rejection import VerifyOutput, target_probs
from pagellm.sampling.typical import TypicalAcceptance
from pagellm.spec_decode.batch import SpecRows


def chain_parents(n: int) -> list[int]:
    return list(range(-1, n - 1))


def tree_step_inputs(sched_out, draft_parents: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
    """Positions and tree mask of a step whose spec rows may carry trees.

    draft_parents: int [len(sched_out.draft_token_ids)], each draft's parent within its row's drafts (-1:
    the row's first token), row by row like the drafts. Returns positions int64 [num_tokens] (a draft's is
    its row's first position + 1 + its depth) and tree_mask bool [num_tokens, max query length]: each row's
    ancestor mask (causal for rows without drafts, [[True]] for a decode)."""
    if len(sched_out.num_draft_tokens) == 1:  # batch 1: the row's tree as cached per shape
        k, n = int(sched_out.num_draft_tokens[0]), int(sched_out.total_num_scheduled_tokens)
        if k and n == 1 + k:
            row_mask, depths = _row_tree(tuple(np.asarray(draft_parents).tolist()))
            return int(sched_out.positions[0]) + depths, row_mask.clone()
    positions = np.array(sched_out.positions, dtype=np.int64, copy=True)
    qsl = np.asarray(sched_out.query_start_loc).astype(np.int64)
    num_drafts = np.asarray(sched_out.num_draft_tokens).astype(np.int64)
    lens = np.diff(qsl)
    mask = torch.zeros((int(qsl[-1]), int(lens.max()) if len(lens) else 1), dtype=torch.bool)
    draft_start = np.concatenate([[0], np.cumsum(num_drafts)])
    parents_flat = np.asarray(draft_parents).tolist()
    for r in range(len(lens)):
        t0, n, k = int(qsl[r]), int(lens[r]), int(num_drafts[r])
        if k and n == 1 + k:
            row_mask, depths = _row_tree(tuple(parents_flat[draft_start[r] : draft_start[r] + k]))
            positions[t0 : t0 + n] = positions[t0] + depths
        else:
            row_mask = torch.ones((n, n), dtype=torch.bool).tril_()
        mask[t0 : t0 + n, :n] = row_mask
    return positions, mask


def pad_tree_step(md, input_ids: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor, num_pad: int,
                  capacity: int):
    """The step with its last row grown by `num_pad` dummy tokens, or None when the row would then pass `capacity`
    keys (its block table's). A dummy token writes no KV (slot -1), sits at the row's last position and sees only
    itself; every real token's attention is unchanged (its context is seq_len - q_len either way, its mask row the
    same, tree_attention_cpu_kernels.h) and so are its linears (row by row). Returns (md, input_ids, positions,
    tree_mask) with num_tokens + num_pad tokens, the pads last.

    Why: the scheduler clamps a request's last drafts to a prefix of its tree (max_tokens), and each prefix was a
    step-graph key of its own: two eager forwards (one of them recorded) per prefix and block-table width, ~8 % of a
    48-token chat answer's time at batch 1 (session 17). Padded to the proposer's full tree, such a step replays the
    full tree's graph."""
    r, n = md.num_reqs - 1, md.num_tokens
    row_len = n - int(md.query_start_loc[r])
    if num_pad <= 0 or int(md.seq_lens[r]) + num_pad > capacity:
        return None
    seq_lens, qsl = md.seq_lens.clone(), md.query_start_loc.clone()
    seq_lens[r] += num_pad
    qsl[r + 1 :] += num_pad
    mask = tree_mask.new_zeros((n + num_pad, max(tree_mask.shape[1], row_len + num_pad)))
    mask[:n, : tree_mask.shape[1]] = tree_mask
    pads = torch.arange(num_pad)
    mask[n + pads, row_len + pads] = True
    md = replace(md, num_tokens=n + num_pad, max_query_len=max(md.max_query_len, row_len + num_pad),
                 max_seq_len=max(md.max_seq_len, int(seq_lens[r])), seq_lens=seq_lens, query_start_loc=qsl,
                 slot_mapping=torch.cat([md.slot_mapping, md.slot_mapping.new_full((num_pad,), -1)]))
    return (md, torch.cat([input_ids, input_ids.new_zeros(num_pad)]),
            torch.cat([positions, positions[-1:].expand(num_pad)]), mask.to(tree_mask.device))


@lru_cache(maxsize=256)
def _row_tree(draft_parents: tuple[int, ...]) -> tuple[torch.Tensor, np.ndarray]:
    """A spec row's ancestor mask [1 + k, 1 + k] (its first token the root) and depths [1 + k], per tree shape: a
    proposer serves one or a few shapes, and building the mask node by node cost ~0.1 ms a verify step. The mask is
    only read (copied into the step's mask)."""
    row_mask = tree_mask_from_parents([-1] + [p + 1 for p in draft_parents])
    return row_mask, (row_mask.sum(dim=1).numpy() - 1).astype(np.int64)  # depth = ancestors


def longest_accepted_path(parents: Sequence[int], accepted: Sequence[bool]) -> list[int]:
    """The longest root-to-node path of accepted nodes (parents before children; the first such node in node
    order on ties), as draft indices, shallowest first."""
    length = [0] * len(parents)
    best = -1
    for j, p in enumerate(parents):
        if accepted[j] and (p < 0 or length[p] > 0):
            length[j] = 1 + (length[p] if p >= 0 else 0)
            if best < 0 or length[j] > length[best]:
                best = j
    path = []
    while best >= 0:
        path.append(best)
        best = parents[best]
    return path[::-1]


def greedy_tree_path(target_ids: Sequence[int], drafts: Sequence[int], parents: Sequence[int]) -> list[int]:
    """The longest root-to-node path the target agrees with. target_ids [1 + k]: the target's token after
    the row's first token (index 0) and after each draft j (index 1 + j); drafts / parents [k]. Returns the
    path's draft indices, shallowest first."""
    return longest_accepted_path(parents, [int(d) == int(target_ids[p + 1]) for d, p in zip(drafts, parents)])


def typical_tree_path(probs: torch.Tensor, drafts: Sequence[int], parents: Sequence[int],
                      rule: TypicalAcceptance) -> list[int]:
    """The longest root-to-node path whose every node passes typical acceptance (sampling/typical.py). probs
    [1 + k, V]: the row's target distributions after its first token (0) and after each draft j (1 + j)."""
    if not len(drafts):
        return []
    pos = torch.tensor([p + 1 for p in parents], dtype=torch.int64, device=probs.device)
    ids = torch.tensor(list(drafts), dtype=torch.int64, device=probs.device)
    p_draft = probs[pos, ids]
    return longest_accepted_path(parents, (p_draft > rule.thresholds(probs)[pos]).tolist())


def typical_tree_paths(split: SpecRows, parents_per_row: Sequence[list[int] | None],
                       rows: Sequence[SamplingRow] | None, spec_logits: torch.Tensor,
                       rule: TypicalAcceptance | None, vocab_size: int) -> dict[int, list[int]]:
    """Under typical acceptance, the path of every sampled tree row (by spec row index; {} without a rule):
    each node judged on the row's processed target distribution at its parent, the context being the row's
    outputs plus the node's ancestors. spec_logits [sum(1 + k_i), V]; rows: the spec rows' SamplingRows (None when
    every row is plain greedy)."""
    if rule is None or rows is None:  # rows None: every row plain greedy, none judged by the rule
        return {}
    starts = np.concatenate([[0], np.cumsum([1 + len(d) for d in split.draft_token_ids])])
    picked = [i for i, (row, parents) in enumerate(zip(rows, parents_per_row))
              if parents is not None and not row.params.is_greedy and split.draft_token_ids[i]]
    if not picked:
        return {}
    drafts = [split.draft_token_ids[i] for i in picked]
    parents = [parents_per_row[i] for i in picked]
    md = build_sampling_metadata(expand_rows_for_verify([rows[i] for i in picked], drafts, parents), vocab_size,
                                 device=spec_logits.device)
    logit_rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in picked])
    probs = target_probs(spec_logits[torch.as_tensor(logit_rows, device=spec_logits.device)], md)
    out, start = {}, 0
    for i, d, p in zip(picked, drafts, parents):
        out[i] = typical_tree_path(probs[start : start + 1 + len(d)], d, p, rule)
        start += 1 + len(d)
    return out


def move_kv_slots(worker, src_slots: list[int], dst_slots: list[int]) -> None:
    """Copy the KV rows of cache slots src -> dst in every layer's cache (keys, values and their scales);
    every source is read before any destination is written. Runs on each worker (collective_rpc)."""
    if not src_slots:
        return
    caches = worker.runner.kv_caches
    tensors = list(caches.tensors())
    if ops.ops_available()[0] and all(t.device.type == "cpu" for t in tensors):
        # one op over every tensor: the Python moves below cost ~4 us per (tensor, slot) over ~60 cache tensors, run
        # cold after the forward (a moved path's commit averaged 0.1 ms a tree step, session 19)
        pairs = [(s, d) for d, s in sorted(zip(dst_slots, src_slots))]  # the order the paths below write in
        ops.copy_slots(tensors, torch.tensor(pairs, dtype=torch.long))
        return
    block_size = caches[caches.layer_ids[0]].key_cache.shape[2]
    pairs = sorted(zip(dst_slots, src_slots))
    if _in_place_safe(pairs):  # a tree path's moves: row by row, basic indexing (views and copy_ only)
        # [num_blocks, num_kv_heads, block_size, ...]: ~4 us per (tensor, pair), where the advanced-indexing gather /
        # scatter pair below cost ~8 us per tensor plus the index arithmetic per tensor (a verify step moving a path
        # paid ~1 ms over 60 cache tensors)
        where = [(d // block_size, d % block_size, s // block_size, s % block_size) for d, s in pairs]
        for t in tensors:
            for d_b, d_o, s_b, s_o in where:
                t[d_b, :, d_o].copy_(t[s_b, :, s_o])
        return
    src = torch.as_tensor([s for _, s in pairs], dtype=torch.long)
    dst = torch.as_tensor([d for d, _ in pairs], dtype=torch.long)
    s_b, s_o, d_b, d_o = src // block_size, src % block_size, dst // block_size, dst % block_size
    for t in tensors:
        if s_b.device != t.device:
            s_b, s_o, d_b, d_o = (x.to(t.device) for x in (s_b, s_o, d_b, d_o))
        rows = t[s_b, :, s_o].clone()  # [n, num_kv_heads, ...]
        t[d_b, :, d_o] = rows


def _in_place_safe(pairs: list[tuple[int, int]]) -> bool:
    """Whether copying (dst, src) pairs one after another in this order reads every source before it is overwritten
    (no source is an earlier pair's destination) and writes each destination once: then no copy of the rows is
    needed. A tree path's moves always are (node j of the path sits in slot >= j, moved to slot j, in order)."""
    written: set[int] = set()
    for d, s in pairs:
        if s in written or d in written:
            return False
        written.add(d)
    return True


@dataclass
class TreePaths:
    """The path each spec row verifies as a chain (a chain row: all its drafts; a tree row: its greedy path).

    original_split / chain_split: the step's SpecRows as scheduled / with each row's drafts replaced by its path's tokens
    chain_logit_rows: int64 [sum(1 + len(path))] rows of the step's spec logits the chains read, row by row
    paths: per spec row, the path's draft indices; depths: seq_id -> drafts counted in the statistics
    target_ids: the target's raw argmax at every spec logits row of the step (what the greedy paths were chosen by)
    """

    original_split: SpecRows
    chain_split: SpecRows
    chain_logit_rows: np.ndarray
    paths: list[list[int]]
    tree_rows: list[bool]
    depths: dict[str, int]
    target_ids: Sequence[int] = ()


def choose_tree_paths(split: SpecRows, parents_per_row: Sequence[list[int] | None], target_ids: Sequence[int],
                      seq_ids: Sequence[str], chosen: dict[int, list[int]] | None = None) -> TreePaths:
    """Per spec row (parents None: a chain) the path to verify. target_ids [sum(1 + k_i)]: the target's raw
    argmax at every spec logits row (greedy paths); seq_ids: the spec rows' sequences; chosen: paths already
    picked by another rule (typical acceptance), by spec row index."""
    chains, rows, paths, is_tree, depths = [], [], [], [], {}
    start = 0
    for i, (drafts, parents, sid) in enumerate(zip(split.draft_token_ids, parents_per_row, seq_ids)):
        k = len(drafts)
        if parents is None:
            path = list(range(k))
            depths[sid] = k
        else:
            path = (chosen or {}).get(i)
            if path is None:
                path = greedy_tree_path(target_ids[start : start + 1 + k], drafts, parents)
            depths[sid] = max(tree_depths(parents)) + 1 if k else 0
        paths.append(path)
        is_tree.append(parents is not None)
        chains.append([drafts[j] for j in path])
        rows.extend([start] + [start + 1 + j for j in path])
        start += 1 + k
    chain_split = replace(split, draft_token_ids=chains)
    return TreePaths(split, chain_split, np.asarray(rows, dtype=np.int64), paths, is_tree, depths, target_ids)


def verify_greedy_paths(paths: TreePaths) -> VerifyOutput:
    """What sampler.verify gives the chosen paths when every spec row is plain greedy (no logprobs, no processors:
    RequestState.plain_greedy), from the argmax rows the paths were chosen by: each row's path tokens up to the first
    one the target's argmax before it disagrees with (a chain row's drafts are not checked by choose_tree_paths),
    then the target's token there. The sampler's greedy rule on the same rows of the same logits, without a second
    argmax and the chain's copy of its logits rows (~0.1 ms of a batch-1 tree step)."""
    accepted, offset = [], 0
    rows = paths.chain_logit_rows.tolist()
    for chain in paths.chain_split.draft_token_ids:
        targets = [int(paths.target_ids[r]) for r in rows[offset : offset + 1 + len(chain)]]
        num_ok = 0
        while num_ok < len(chain) and int(chain[num_ok]) == targets[num_ok]:
            num_ok += 1
        accepted.append([int(t) for t in chain[:num_ok]] + [targets[num_ok]])
        offset += 1 + len(chain)
    return VerifyOutput(accepted_token_ids=accepted, num_accepted_tokens=[len(a) for a in accepted])


def reordered_drafts(split: SpecRows, paths: Sequence[list[int]], num_accepted: Sequence[int]) -> list[int]:
    """The step's drafts, flat, with each row's accepted path moved to the front (what update() checks)."""
    flat: list[int] = []
    for drafts, path, a in zip(split.draft_token_ids, paths, num_accepted):
        front = path[:a]
        rest = [j for j in range(len(drafts)) if j not in set(front)]
        flat.extend(int(drafts[j]) for j in front + rest)
    return flat
