"""Prompt-lookup matching for the `ngram` method (ngram.py): where the sequence's suffix occurred before, the
tokens that followed (a chain), and several such continuations merged into a candidate tree.

Plain numpy over one sequence; no state between calls.
"""

from __future__ import annotations

import heapq

import numpy as np

MAX_TREE_MATCHES = 64  # earlier occurrences a tree is built from (the best-ranked ones)


def suffix_matches(token_ids: np.ndarray, max_n: int) -> tuple[np.ndarray, np.ndarray]:
    """The earlier occurrences of the last token of `token_ids` [num_ids] (int64): their positions `ends`
    (ascending) and, per occurrence, how many tokens ending there equal the sequence's suffix (at most max_n).

    Vectorised: a match length grows one comparison over all candidates per step back, so the Python loop
    runs max_n times, never over the tokens."""
    last = len(token_ids) - 1
    if last < 1:
        return token_ids[:0], token_ids[:0]
    ends = np.flatnonzero(token_ids[:last] == token_ids[last])
    length = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, min(max_n, last)):  # the suffix is token_ids[last - back .. last]
        if not alive.any():
            break
        pos = ends - back
        alive &= pos >= 0
        alive[alive] = token_ids[pos[alive]] == token_ids[last - back]
        length += alive
    return ends, length


def continuation(token_ids: np.ndarray, end: int, num_tokens: int) -> np.ndarray:
    """The `num_tokens` tokens after position `end`, read on cyclically when they reach the end of the
    sequence: the suffix recurs after them, so what followed the match follows again (a loop of period p
    yields num_tokens drafts, not p)."""
    start = end + 1
    return token_ids[start + np.arange(num_tokens) % (len(token_ids) - start)]


def find_ngram_continuation(token_ids: np.ndarray, min_n: int, max_n: int, num_tokens: int) -> np.ndarray:
    """Drafts for one sequence `token_ids` [num_ids] (int64): the `num_tokens` tokens following the most
    recent earlier occurrence of the longest suffix of length n in [min_n, max_n], read on cyclically
    when they reach the end of the sequence (empty: no match)."""
    if num_tokens < 1:
        return token_ids[:0]
    ends, length = suffix_matches(token_ids, max_n)
    if not len(ends) or int(length.max()) < min_n:
        return token_ids[:0]
    best = int(length.max())
    return continuation(token_ids, int(ends[np.flatnonzero(length == best)[-1]]), num_tokens)


def ngram_candidate_tree(token_ids: np.ndarray, min_n: int, max_n: int, depth: int,
                         max_nodes: int) -> tuple[list[int], list[int]]:
    """A token tree of earlier continuations of the suffix (lookahead-decoding / SGLang-style n-gram trees).

    Every earlier occurrence whose match with the suffix is >= min_n tokens long (at most max_n counted; the
    MAX_TREE_MATCHES best by length, then recency) gives its next `depth` tokens (`continuation`); they are
    merged into a trie where a node weighs the summed match lengths of the occurrences through it (frequent
    and long-context continuations first). The `max_nodes` heaviest nodes are taken best-first (a node only
    after its parent; ties: the better-ranked occurrence's), so the list has parents before children and every
    prefix of it is a tree. Returns (tokens, parents): parents[j] is node j's parent index, -1 under the
    root (the sequence's last token). Empty lists: no match. A single match gives the chain
    find_ngram_continuation gives."""
    if depth < 1 or max_nodes < 1:
        return [], []
    ends, length = suffix_matches(token_ids, max_n)
    keep = np.flatnonzero(length >= min_n)
    if not len(keep):
        return [], []
    order = keep[np.lexsort((-ends[keep], -length[keep]))][:MAX_TREE_MATCHES]  # longest, then most recent
    starts = ends[order] + 1
    periods = len(token_ids) - starts
    conts = token_ids[starts[:, None] + np.arange(depth)[None, :] % periods[:, None]].tolist()
    node_of: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    tokens, parents, weights = [], [], []
    for cont, w in zip(conts, length[order].tolist()):
        parent = -1
        for t in cont:
            node = node_of.get((parent, t))
            if node is None:
                node = node_of[(parent, t)] = len(tokens)
                tokens.append(t)
                parents.append(parent)
                weights.append(0)
            weights[node] += w
            parent = node
    children: dict[int, list[int]] = {}
    for node, p in enumerate(parents):
        children.setdefault(p, []).append(node)
    heap = [(-weights[c], c) for c in children.get(-1, [])]
    heapq.heapify(heap)
    picked, new_index = [], {-1: -1}
    while heap and len(picked) < max_nodes:
        _, node = heapq.heappop(heap)
        new_index[node] = len(picked)
        picked.append(node)
        for c in children.get(node, []):
            heapq.heappush(heap, (-weights[c], c))
    return [tokens[n] for n in picked], [new_index[parents[n]] for n in picked]
