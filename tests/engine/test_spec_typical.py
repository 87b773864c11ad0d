"""Typical acceptance (sampling/typical.py): the rule itself, verify_drafts with it (every accepted draft is above
the rule's threshold, it accepts at least what rejection sampling accepts on high-entropy rows, greedy rows are
untouched, seeded rows reproducible), the speculative_config keys, and the engine with Medusa drafts."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from test_draft_tokens import MAX_TOKENS, _assert_all_blocks_free, _generate, _greedy, _make_llm  # noqa: E402
from test_spec_medusa import hf_base, test_prompts, trained_heads_dir, vocab  # noqa: E402,F401 (fixtures)

from pagellm import SamplingParams  # noqa: E402
from pagellm.engine.tree_step import longest_accepted_path, typical_tree_path  # noqa: E402
from pagellm.sampling import Sampler, SamplingRow, build_sampling_metadata, expand_rows_for_verify  # noqa: E402
from pagellm.sampling.typical import TypicalAcceptance  # noqa: E402
from pagellm.spec_decode import SpeculativeConfig  # noqa: E402


def _entropy(p: torch.Tensor) -> torch.Tensor:
    """-sum p log p per row, in float64 (0 log 0 = 0)."""
    p = p.double()
    return -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)


def test_thresholds_follow_the_rule():
    probs = torch.softmax(torch.randn(7, 33, generator=torch.Generator().manual_seed(0)) * 3, dim=-1)
    probs[0] = 0.0
    probs[0, 5] = 1.0  # zero entropy: the threshold is min(threshold, alpha)
    rule = TypicalAcceptance(posterior_threshold=0.2, posterior_alpha=0.5)
    expect = torch.minimum(torch.full((7,), 0.2, dtype=torch.float64), 0.5 * torch.exp(-_entropy(probs)))
    torch.testing.assert_close(rule.thresholds(probs).double(), expect, rtol=1e-5, atol=1e-7)
    assert rule.num_accepted(probs[:1].expand(3, -1), [5, 5, 4]) == 2  # p = 1, 1, then 0


def _verify(logits, drafts_per_row, params_per_row, typical, seed=0, generators=None):
    rows = [SamplingRow(p, [1], [], None if generators is None else generators[i])
            for i, p in enumerate(params_per_row)]
    md = build_sampling_metadata(expand_rows_for_verify(rows, drafts_per_row), logits.shape[1])
    sampler = Sampler(torch.Generator().manual_seed(seed))
    sampler.set_acceptance(typical)
    return sampler.verify(logits, drafts_per_row, md)


def _high_entropy_batch(num_rows: int, k: int, vocab: int, seed: int):
    """Flat target logits (temperature 1.5 over small random logits) and drafts drawn from a different random
    distribution: each draft is a plausible but far from certain token."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows * (k + 1), vocab, generator=gen) * 0.5
    drafts = torch.randint(0, vocab, (num_rows, k), generator=gen).tolist()
    return logits, drafts


def test_accepted_drafts_are_above_the_threshold_and_typical_accepts_more_on_flat_rows():
    k, vocab, n = 3, 40, 300
    logits, drafts = _high_entropy_batch(n, k, vocab, seed=1)
    params = [SamplingParams(temperature=1.5, top_k=30) for _ in range(n)]
    rule = TypicalAcceptance()
    typical = _verify(logits, drafts, params, rule)
    rejection = _verify(logits, drafts, params, None)
    # the processed target distributions, computed here: temperature, then top-k, then softmax
    scaled = logits / 1.5
    kth = scaled.topk(30, dim=-1).values[:, -1:]
    probs = torch.softmax(scaled.masked_fill(scaled < kth, float("-inf")), dim=-1)
    thresholds = torch.minimum(torch.full((len(probs),), 0.09, dtype=torch.float64), 0.3 * torch.exp(-_entropy(probs)))
    num_checked = 0
    for i, tokens in enumerate(typical.accepted_token_ids):
        accepted = tokens[:-1]
        assert accepted == drafts[i][: len(accepted)]
        for j, tok in enumerate(accepted):  # every accepted draft beat its position's threshold
            assert float(probs[i * (k + 1) + j, tok]) > float(thresholds[i * (k + 1) + j])
            num_checked += 1
        if len(accepted) < k:  # the first refused draft did not
            pos = i * (k + 1) + len(accepted)
            assert float(probs[pos, drafts[i][len(accepted)]]) <= float(thresholds[pos]) + 1e-6
        assert probs[i * (k + 1) + len(accepted), tokens[-1]] > 0  # the emitted token is a draw from p_j
    assert num_checked > 0
    assert sum(typical.num_accepted_tokens) >= sum(rejection.num_accepted_tokens)
    assert sum(typical.num_accepted_tokens) > sum(rejection.num_accepted_tokens) + n // 2  # not a tie: flat rows


def test_greedy_rows_are_untouched_and_seeded_rows_reproducible():
    k, vocab = 2, 16
    logits, drafts = _high_entropy_batch(6, k, vocab, seed=2)
    drafts[0] = [int(logits[0].argmax()), int(logits[1].argmax())]  # a greedy row whose drafts all match
    greedy = SamplingParams(temperature=0.0)
    params = [greedy, greedy, greedy] + [SamplingParams(temperature=1.0, seed=s) for s in (5, 6, 7)]

    def run(seed):
        gens = [None] * 3 + [torch.Generator().manual_seed(s) for s in (5, 6, 7)]
        return _verify(logits, drafts, params, TypicalAcceptance(), seed=seed, generators=gens)

    with_rule = run(0)
    plain = _verify(logits, drafts, params, None)
    assert with_rule.accepted_token_ids[:3] == plain.accepted_token_ids[:3]
    assert with_rule.accepted_token_ids[0] == drafts[0] + [int(logits[2].argmax())]
    assert run(0).accepted_token_ids == run(1).accepted_token_ids == with_rule.accepted_token_ids  # own seeds


@pytest.mark.parametrize("options,match", [
    ({"acceptance": "greedy"}, "acceptance must be one of \\['rejection', 'typical'\\]"),
    ({"acceptance": "typical", "posterior_threshold": 0.0}, "posterior_threshold must be a number in \\(0, 1\\]"),
    ({"acceptance": "typical", "posterior_alpha": 1.5}, "posterior_alpha must be a number in \\(0, 1\\]"),
    ({"acceptance": "typical", "posterior_alpha": "0.3"}, "posterior_alpha must be a number"),
    ({"posterior_threshold": 0.1}, "only used with acceptance='typical'"),
])
def test_bad_acceptance_options_raise_at_construction(options, match):
    for method in ({"method": "medusa", "model": "/x"}, {"method": "ngram"}):  # a key every method takes
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.from_dict({**method, "num_speculative_tokens": 2, **options})
    with pytest.raises(ValueError, match="posterior_threshold must be a number in"):
        TypicalAcceptance(posterior_threshold=1.01)


def test_config_round_trip():
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "acceptance": "typical",
                                          "posterior_alpha": 0.5})
    assert config.typical_acceptance == TypicalAcceptance(posterior_threshold=0.09, posterior_alpha=0.5)
    assert SpeculativeConfig.from_dict(config.to_dict()) == config
    plain = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2})
    assert plain.typical_acceptance is None


# ---------------------------------------------------------------- trees: the longest accepted path


def test_longest_accepted_path_and_typical_tree_path():
    parents = [-1, -1, 0, 0, 1, 3, 4]  # depth: 0 0 1 1 1 2 2
    assert longest_accepted_path(parents, [1, 1, 1, 1, 1, 0, 1]) == [1, 4, 6]  # node 5 refused: 1 -> 4 -> 6 wins
    assert longest_accepted_path(parents, [1, 1, 1, 1, 1, 1, 1]) == [0, 3, 5]  # tie at depth 3: first in order
    assert longest_accepted_path(parents, [0, 1, 1, 1, 0, 1, 1]) == [1]  # children of a refused node do not count
    assert longest_accepted_path(parents, [0] * 7) == []
    # typical: position 0 (after the root) is flat over tokens 0..3, position 1 + j follows draft j
    vocab, rule = 8, TypicalAcceptance()
    probs = torch.zeros(1 + len(parents), vocab)
    probs[0, :4] = 0.25
    probs[1:, 5] = 0.97  # every later position is sure of token 5 ...
    probs[1:, 6] = 0.03  # ... and 6 is below min(0.09, 0.3 * exp(-H)) there
    drafts = [2, 7, 5, 6, 5, 5, 5]  # node 1 (token 7) has probability 0 at the root: refused
    assert typical_tree_path(probs, drafts, parents, rule) == [0, 2]  # node 3 (token 6) fails; 5 is under it
    drafts[3] = 5  # now node 3 passes and so does its child 5: depth 3
    assert typical_tree_path(probs, drafts, parents, rule) == [0, 3, 5]


def test_tree_rows_see_their_ancestors_as_outputs():
    params = SamplingParams(temperature=1.0, presence_penalty=0.5)  # a penalty: positions read the outputs
    row = SamplingRow(params, [1], [9], None)
    expanded = expand_rows_for_verify([row], [[4, 5, 6]], [[-1, -1, 1]])  # node 2 under node 1
    assert [list(r.output_token_ids) for r in expanded] == [[9], [9, 4], [9, 5], [9, 5, 6]]
    chain = expand_rows_for_verify([row], [[4, 5, 6]])
    assert [list(r.output_token_ids) for r in chain] == [[9], [9, 4], [9, 4, 5], [9, 4, 5, 6]]


# ---------------------------------------------------------------- the engine, Medusa drafts


def _medusa_llm(model_dir, heads_dir, **spec):
    config = {"method": "medusa", "num_speculative_tokens": 3, "model": str(heads_dir), "disable_by_batch_size": 8,
              "adaptive": False, **spec}  # every step drafts: the acceptance rules are compared, not the switch
    return _make_llm(model_dir, speculative_config=config)


def _sampled_acceptance(llm, prompts, params):
    """(outputs, accepted / proposed drafts) of one generate() call."""
    stats = llm.llm_engine.spec_stats
    drafts, accepted = stats.num_draft_tokens, stats.num_accepted_draft_tokens
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert stats.num_proposer_errors == 0 and stats.num_draft_tokens > drafts
    return outs, (stats.num_accepted_draft_tokens - accepted) / (stats.num_draft_tokens - drafts)


def test_engine_typical_acceptance(tiny_llama_dir, test_prompts, trained_heads_dir):
    """Greedy rows as with rejection sampling (itself token-identical to plain decoding, test_spec_medusa.py);
    sampled rows at a high temperature accept more drafts, and seeded requests repeat."""
    prompts = test_prompts[4]
    sampled = [SamplingParams(temperature=1.5, seed=11 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
               for i in range(len(prompts))]
    rejection = _medusa_llm(tiny_llama_dir, trained_heads_dir)
    typical = _medusa_llm(tiny_llama_dir, trained_heads_dir, acceptance="typical")
    assert [o.token_ids for o in _generate(typical, prompts, _greedy())] == \
        [o.token_ids for o in _generate(rejection, prompts, _greedy())]
    _, rate_rejection = _sampled_acceptance(rejection, prompts, sampled)
    outs, rate_typical = _sampled_acceptance(typical, prompts, sampled)
    assert rate_typical > rate_rejection, (rate_typical, rate_rejection)
    again, _ = _sampled_acceptance(typical, prompts, sampled)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)


def test_engine_sampled_rows_take_trees_under_typical_acceptance(tiny_llama_dir, test_prompts, trained_heads_dir):
    prompts = test_prompts[4][:2]
    sampled = [SamplingParams(temperature=1.0, seed=21 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
               for i in range(len(prompts))]
    llm = _medusa_llm(tiny_llama_dir, trained_heads_dir, acceptance="typical", tree="default")
    proposer = llm.llm_engine.proposer
    tree_rows = []
    original = proposer.propose

    def recording(requests):
        out = original(requests)
        tree_rows.extend(proposer._tree_rows)
        return out

    proposer.propose = recording
    outs, rate = _sampled_acceptance(llm, prompts, sampled)
    assert tree_rows and rate > 0  # sampled rows took trees and paths were accepted
    again, _ = _sampled_acceptance(llm, prompts, sampled)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)
    _assert_all_blocks_free(llm.llm_engine)
