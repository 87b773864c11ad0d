"""The incremental prompt-lookup matcher (spec_decode/ngram_index.py) and ngram's per-request draft length: the
match chosen against a plain-Python definition (longest agreement up to prompt_lookup_max, then the followed match,
then the most recent), followed matches growing past prompt_lookup_max, the per-sequence cache (extension, rebuild,
release), the `draft_length` option, and greedy outputs equal to plain decoding at k = 12 on the tiny model."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagellm.spec_decode import DraftRequest, SpeculativeConfig
from pagellm.spec_decode.ngram import NgramProposer
from pagellm.spec_decode.ngram_index import MatcherCache, SequenceMatcher
from pagellm.spec_decode.ngram_match import find_ngram_continuation


def _agreement(tokens: list[int], end: int, cap: int) -> int:
    """How many tokens ending at `end` equal the sequence's suffix (at most cap)."""
    n, length = len(tokens), 0
    while length < cap and end - length >= 0 and tokens[end - length] == tokens[n - 1 - length]:
        length += 1
    return length


def _best_capped(tokens: list[int], max_n: int) -> int:
    return max((_agreement(tokens, e, max_n) for e in range(len(tokens) - 1)), default=0)


@pytest.mark.parametrize("vocab", [2, 3, 7, 50])
def test_fresh_matcher_equals_the_stateless_lookup(vocab):
    """Built in one go (nothing followed yet), the matcher drafts what find_ngram_continuation drafts."""
    rng = random.Random(vocab)
    for _ in range(300):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
        lo = rng.randrange(1, 5)
        hi = rng.randrange(lo, 9)
        k = rng.randrange(1, 7)
        m = SequenceMatcher()
        m.extend(tokens)
        end, agreed = m.find(lo, hi)
        want = find_ngram_continuation(np.asarray(tokens, dtype=np.int64), lo, hi, k).tolist()
        got = m.continuation(end, k).tolist() if end >= 0 else []
        assert got == want, (tokens, lo, hi, k)
        if end >= 0:
            assert agreed == _agreement(tokens, end, hi) == _best_capped(tokens, hi)


@pytest.mark.parametrize("vocab", [2, 4, 30])
def test_incremental_matcher_keeps_the_longest_match(vocab):
    """Grown a few tokens at a time with a lookup in between: the match always has the longest agreement counted up
    to prompt_lookup_max, and its reported length never exceeds its true agreement."""
    rng = random.Random(100 + vocab)
    for _ in range(60):
        lo, hi = rng.randrange(1, 3), rng.randrange(2, 6)
        tokens, m = [], SequenceMatcher()
        for _ in range(40):
            new = [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]
            if tokens and rng.random() < 0.5:  # copy an earlier stretch: matches get followed
                start = rng.randrange(len(tokens))
                new = tokens[start : start + rng.randrange(1, 6)] or new
            tokens += new
            m.extend(new)
            end, agreed = m.find(lo, hi)
            best = _best_capped(tokens, hi)
            if best < lo:
                assert end == -1 and agreed == 0
                continue
            assert 0 <= end < len(tokens) - 1
            assert min(agreed, hi) == _agreement(tokens, end, hi) == best
            assert agreed <= _agreement(tokens, end, len(tokens))


def test_followed_match_grows_past_prompt_lookup_max():
    text = list(range(10, 40))
    m = SequenceMatcher()
    m.extend(text + [99] + text[:3])  # the copy of `text` starts: a 3-token match
    end, agreed = m.find(1, 4)
    assert (end, agreed) == (2, 3)
    m.extend(text[3:20])  # the copy goes on: the match is followed, no lookup needed
    end, agreed = m.find(1, 4)
    assert (end, agreed) == (19, 20)
    assert m.continuation(end, 5).tolist() == text[20:25]
    m.extend([7])  # the text leaves the copy: a fresh lookup (7 never occurred: no match)
    assert m.find(1, 4) == (-1, 0)


def test_ties_go_to_the_followed_match():
    a = [1, 2, 3, 4, 5, 6]
    m = SequenceMatcher()
    m.extend(a + [9] + a[:4])  # following the first copy (4 agreeing tokens, the cap)
    assert m.find(1, 4) == (3, 4)
    m.extend([5, 8, 1, 2, 3, 4])  # 5 follows; 8 breaks it; then 1 2 3 4 again: two occurrences agree 4 tokens
    end, agreed = m.find(1, 4)
    assert agreed == 4 and end == 10  # the most recent of the tied ones (the followed match broke)


def test_matcher_cache_extends_rebuilds_and_releases():
    cache = MatcherCache()
    m = cache.matcher("a", [1, 2, 3], [1, 2])
    assert m.num_tokens == 5
    assert cache.matcher("a", [1, 2, 3], [1, 2, 3, 4]) is m and m.num_tokens == 7  # extended in place
    fresh = cache.matcher("a", [1, 2, 3], [9])  # not a continuation of what it indexed: rebuilt
    assert fresh is not m and fresh.tokens[: fresh.num_tokens].tolist() == [1, 2, 3, 9]
    other = cache.matcher("a", [5, 2, 3], [9])  # another prompt under the same id: rebuilt
    assert other is not fresh
    cache.matcher("b", [4], [])
    assert len(cache) == 2
    cache.release(["a", "missing"])
    assert len(cache) == 1


def test_draft_length_follows_the_match():
    text = list(range(10, 40))
    seq = text + [99] + text[:12]  # a copy that has agreed for 12 tokens
    fixed, match = NgramProposer(8, draft_length="fixed"), NgramProposer(8)
    req = DraftRequest("s", seq[:-10], seq[-10:], max_num_drafts=8)
    assert fixed.propose([req]) == {"s": text[12:20]}
    assert match.propose([req]) == {"s": text[12:20]}  # agreed 12 >= k: k drafts
    weak = DraftRequest("w", [5, 6, 7, 8, 1, 2, 3], [5, 6], max_num_drafts=8)  # (5, 6): agreed 2
    assert match.propose([weak]) == {"w": [7, 8]}
    assert len(fixed.propose([weak])["w"]) == 8
    room = DraftRequest("r", seq[:-10], seq[-10:], max_num_drafts=3)
    assert match.propose([room]) == {"r": text[12:15]}
    assert match.propose([DraftRequest("n", [1, 2, 3], [4], max_num_drafts=8)]) == {}  # no match, no drafts
    match.release(["s", "w", "r", "n"])
    assert len(match._matchers) == 0


@pytest.mark.parametrize("value", ["long", "", 3, None, True])
def test_bad_draft_length_raises_naming_the_option(value):
    with pytest.raises(ValueError, match="draft_length"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "draft_length": value})
    with pytest.raises(ValueError, match="draft_length"):
        NgramProposer(4, draft_length=value)


def test_draft_length_is_an_ngram_option():
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 12, "draft_length": "fixed"})
    assert cfg.options == {"draft_length": "fixed"} and cfg.to_dict()["draft_length"] == "fixed"
    with pytest.raises(ValueError, match="unknown keys"):
        SpeculativeConfig.from_dict({"method": "medusa", "num_speculative_tokens": 2, "draft_length": "match"})


@pytest.mark.parametrize("draft_length", ["match", "fixed", "cost"])
def test_long_drafts_greedy_equal_plain_decoding(tiny_llama_dir, tiny_tokenizer, draft_length):
    pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")
    from test_draft_tokens import _assert_all_blocks_free, _generate, _greedy, _make_llm
    from test_spec_ngram import _tie_free

    params = _greedy(40)
    prompts = _tie_free(tiny_llama_dir, len(tiny_tokenizer), params, 6, seed=21)
    ref = _generate(_make_llm(tiny_llama_dir), prompts, params)
    llm = _make_llm(tiny_llama_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 12,
                                                        "draft_length": draft_length, "adaptive": False,
                                                        "disable_by_batch_size": 64})
    eng = llm.llm_engine
    outs = _generate(llm, prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert eng.spec_stats.num_accepted_draft_tokens > 0
    assert len(eng.proposer._matchers) == 0  # every finished sequence's matcher released
    _assert_all_blocks_free(eng)
