"""Candidate trees fitted to trained heads (spec_decode/medusa_tree_fit.py) and served with `"tree": "heads"`:
best-first fitting keeps parents, the tree walk of a chain is the trainer's chain walk, the fitted tree's walk over
the engine's own answers gives the engine's mean accepted length (tiny random Llama, fp32, Hydra heads trained the
trainer's way, every step drafting), and greedy output with the fitted tree is token-identical to plain decoding."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from draft_heads_helpers import HIDDEN, NEW_TOKENS, NUM_HEADS, load_base, train_tiny_heads  # noqa: E402
from test_draft_tokens import _assert_all_blocks_free, _generate, _greedy, _make_llm  # noqa: E402

from pagellm.spec_decode import ProposerContext, SpeculativeConfig  # noqa: E402
from pagellm.spec_decode.hydra_heads import HydraHeads, load_draft_heads  # noqa: E402
from pagellm.spec_decode.medusa import MedusaProposer, MedusaTreeProposer  # noqa: E402
from pagellm.spec_decode.medusa_train import chain_walk, fitted_trees, head_targets, served_lm_head  # noqa: E402
from pagellm.spec_decode.medusa_train_data import final_hidden_states, ragged_positions  # noqa: E402
from pagellm.spec_decode.medusa_tree import MedusaTree  # noqa: E402
from pagellm.spec_decode.medusa_tree_fit import fit_paths, full_tree, path_hits, tree_runs, walk  # noqa: E402


def test_fit_paths_takes_the_best_nodes_whose_parents_are_taken():
    tree = full_tree(2, 2)  # (0,), (1,), (0,0), (0,1), (1,0), (1,1)
    rates = {(0,): 0.6, (1,): 0.2, (0, 0): 0.5, (0, 1): 0.05, (1, 0): 0.19, (1, 1): 0.0}
    rng = torch.Generator().manual_seed(0)
    u = torch.rand(20000, 1, generator=rng)
    hits = torch.cat([u < rates[p] for p in tree.paths], dim=1)  # rate-exact columns (a shared uniform)
    assert fit_paths(tree, hits, 1) == [(0,)]
    assert fit_paths(tree, hits, 3) == [(0,), (1,), (0, 0)]
    assert fit_paths(tree, hits, 4) == [(0,), (1,), (0, 0), (1, 0)]  # (1, 0) only once (1,) is in
    assert len(fit_paths(tree, hits, 99)) == tree.num_nodes


def test_tree_walk_of_a_chain_is_the_chain_walk():
    torch.manual_seed(1)
    chain = MedusaTree.from_spec([[0], [0, 0], [0, 0, 0]])
    hits = torch.rand(300, 3) < torch.tensor([0.6, 0.5, 0.4])
    flat = torch.cat([torch.arange(0, 120), torch.arange(200, 380)])  # two answers
    path = torch.cumprod(hits.long(), dim=1).bool()  # a node hits iff its whole path does
    walked = walk(flat, tree_runs(chain, path).tolist())
    expect = chain_walk(flat, hits)
    assert walked == {"head1": expect["chain_head1"], "accepted_len": expect["chain_accepted_len"]}


@pytest.fixture(scope="module")
def base(tiny_llama_dir):
    return load_base(tiny_llama_dir)


@pytest.fixture(scope="module")
def heads_and_prompts(tmp_path_factory, tiny_llama_dir, tiny_tokenizer, base):
    heads = HydraHeads(HIDDEN, len(tiny_tokenizer), num_heads=NUM_HEADS)
    heads.set_embedding(base.get_input_embeddings().weight)
    return train_tiny_heads(heads, base, tiny_llama_dir, len(tiny_tokenizer), tmp_path_factory.mktemp("hydra-fit"))


def _context(eng) -> ProposerContext:
    return ProposerContext(engine_config=eng.config, model_files=eng.model_files, tokenizer=eng.tokenizer,
                           vocab_size=eng.vocab_size, executor=eng.executor)


def _proposer(eng, heads_dir, tree):
    config = SpeculativeConfig.from_dict({"method": "medusa", "num_speculative_tokens": NUM_HEADS,
                                          "model": str(heads_dir), "adaptive": False, "tree": tree})
    return MedusaProposer.from_config(config, _context(eng))


def _with_fitted_trees(heads_dir, base, texts, prompts):
    """The heads' directory again, its medusa_config.json carrying trees fitted on `texts` (what train_medusa does
    on its held-out answers)."""
    heads = load_draft_heads(heads_dir)
    heads.set_embedding(base.get_input_embeddings().weight)
    ids = torch.tensor([sum(texts, [])])
    hidden = torch.cat([final_hidden_states(base, torch.tensor([t]))[0] for t in texts])[None]
    positions = ragged_positions([len(t) for t in texts], [len(p) - 1 for p in prompts], NUM_HEADS)
    weight = base.get_output_embeddings().weight.detach().float()
    trees = fitted_trees(heads, weight, hidden, ids, positions, row_cost=0.06)
    config_path = heads_dir / "medusa_config.json"
    config = json.loads(config_path.read_text())
    config["training"] = {**config.get("training", {}), "trees": trees}
    config_path.write_text(json.dumps(config))
    return trees, heads, weight, ids, hidden, positions


def test_served_tree_acceptance_is_the_fitted_trees_walk(tiny_llama_dir, base, heads_and_prompts):
    heads_dir, prompts = heads_and_prompts
    plain = _generate(_make_llm(tiny_llama_dir), prompts, _greedy(NEW_TOKENS))
    texts = [p + list(o.token_ids) for p, o in zip(prompts, plain)]
    trees, heads, weight, ids, hidden, positions = _with_fitted_trees(heads_dir, base, texts, prompts)
    assert set(trees) >= {"3", "6", "12", "chain", "served"} and trees["served"] in trees
    assert trees["6"]["accepted_len"] >= trees["3"]["accepted_len"] - 1e-9  # more nodes never accept less here
    llm = _make_llm(tiny_llama_dir)
    eng = llm.llm_engine
    proposer = _proposer(eng, heads_dir, "heads:6")
    assert isinstance(proposer, MedusaTreeProposer)
    assert sorted(list(p) for p in proposer.tree.paths) == sorted(trees["6"]["paths"])  # served top-1 chain first
    eng.set_proposer(proposer)
    served = _generate(llm, prompts, _greedy(NEW_TOKENS))
    assert [o.token_ids for o in served] == [o.token_ids for o in plain]  # lossless
    _assert_all_blocks_free(eng)
    stats = eng.spec_stats
    served_len = 1 + stats.num_accepted_draft_tokens / stats.num_spec_rows
    # the trainer's walk stops NUM_HEADS + 1 tokens before each answer's end, the engine drafts to it
    flat, _ = head_targets(ids, NUM_HEADS, positions)
    tree = MedusaTree.from_spec(trees["6"]["paths"])
    hits = path_hits(heads, served_lm_head(heads, weight), hidden.to(torch.bfloat16), ids, flat, tree,
                     lambda i: heads.draft_vocab[i])
    walked = walk(flat, tree_runs(tree, hits).tolist())["accepted_len"]
    assert walked == pytest.approx(trees["6"]["accepted_len"], abs=1e-3)
    assert stats.num_accepted_draft_tokens > 0 and served_len == pytest.approx(walked, abs=0.1)


def test_heads_tree_option_is_checked(tiny_llama_dir, base, heads_and_prompts, tmp_path):
    heads_dir, prompts = heads_and_prompts
    eng = _make_llm(tiny_llama_dir).llm_engine
    with pytest.raises(ValueError, match="heads:N"):
        SpeculativeConfig.from_dict({"method": "medusa", "num_speculative_tokens": 3, "model": str(heads_dir),
                                     "tree": "heads:six"})
    bare = load_draft_heads(heads_dir)
    bare.training_info.pop("trees", None)
    bare_dir = bare.save(tmp_path / "bare")
    with pytest.raises(ValueError, match="no fitted trees"):
        _proposer(eng, bare_dir, "heads")
    plain = _generate(_make_llm(tiny_llama_dir), prompts[:2], _greedy(NEW_TOKENS))
    texts = [p + list(o.token_ids) for p, o in zip(prompts[:2], plain)]
    trees = _with_fitted_trees(heads_dir, base, texts, prompts[:2])[0]
    with pytest.raises(ValueError, match="fitted sizes"):
        _proposer(eng, heads_dir, "heads:5")
    served = _proposer(eng, heads_dir, "heads")
    assert [list(p) for p in served.tree.paths] == trees[str(trees["served"])]["paths"]
