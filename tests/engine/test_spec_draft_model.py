"""The `draft_model` proposer (spec_decode/draft_model.py) on a tiny random Llama (fp32): a draft equal to the
target is always accepted, a self-draft (the target's first layer, weights shared) keeps greedy outputs
token-identical to plain decoding (batch 1 and 8, prefix caching, preemption, a full draft cache), int8 and
GGUF drafts load with pagellm's loader, the
draft's incremental KV (rollback of rejected drafts) gives the drafts a fresh draft computes, every
block of the target and the draft comes back, and bad configurations are refused."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from tiny_models import write_tiny_llama  # noqa: E402
from scheduler_probes import CountingScheduler  # noqa: E402
from test_draft_tokens import (  # noqa: E402  (the plain-decoding references and helpers of the spec seam)
    _assert_all_blocks_free,
    _generate,
    _greedy,
    _make_llm,
    _prompts,
    _reference,
    _tie_free_prompts,
)

from pagellm import SamplingParams  # noqa: E402
from pagellm.spec_decode import DraftRequest, ProposerContext, SpeculativeConfig, list_proposers  # noqa: E402
from pagellm.spec_decode.draft_model import FREE_AFTER_IDLE_CALLS, DraftModelProposer  # noqa: E402


@pytest.fixture(scope="module")
def vocab(tiny_tokenizer):
    return len(tiny_tokenizer)


def _context(eng) -> ProposerContext:
    return ProposerContext(engine_config=eng.config, model_files=eng.model_files, tokenizer=eng.tokenizer,
                           vocab_size=eng.vocab_size, executor=eng.executor)


def _proposer(eng, k: int, **options) -> DraftModelProposer:
    config = SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": k, **options})
    return DraftModelProposer.from_config(config, _context(eng))


def _assert_draft_blocks_free(proposer: DraftModelProposer) -> None:
    bm = proposer.runner.block_manager
    assert proposer.num_tracked_seqs == 0 and bm.num_seqs == 0
    assert bm.num_free_blocks == bm.num_blocks


def _run_with_draft(path, prompts, params, k, llm_kw=None, **options):
    llm = _make_llm(path, **(llm_kw or {}))
    eng = llm.llm_engine
    proposer = _proposer(eng, k, **options)
    eng.set_proposer(proposer, disable_by_batch_size=64)  # batch 8 here: drafts in every step
    outs = _generate(llm, prompts, params)
    assert eng.spec_stats.num_proposer_errors == 0  # a raising proposer would silently mean "no drafts"
    return outs, eng, proposer


# ---------------------------------------------------------------- (a) the target as its own draft


def test_draft_equal_to_target_is_always_accepted(tiny_llama_dir, vocab):
    prompts = _tie_free_prompts(tiny_llama_dir, vocab, _greedy())
    ref_outs, _, ref_steps = _reference(tiny_llama_dir, prompts, _greedy())
    outs, eng, proposer = _run_with_draft(tiny_llama_dir, prompts, _greedy(), 4, model=str(tiny_llama_dir))
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref_outs]
    stats = eng.spec_stats
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate == 1.0
    # its own weights (loaded again), not the target's tensors
    assert proposer.runner.model.lm_head.weight.data_ptr() != eng.model.lm_head.weight.data_ptr()
    _assert_all_blocks_free(eng)
    _assert_draft_blocks_free(proposer)


# ---------------------------------------------------------------- (b) (c) a self-draft: the first layer


@pytest.mark.parametrize("batch", [1, 8])
def test_self_draft_first_layer_matches_plain_greedy(tiny_llama_dir, vocab, batch):
    lens = [13] if batch == 1 else [3, 9, 17, 26, 40, 5, 12, 21]
    prompts = _tie_free_prompts(tiny_llama_dir, vocab, _greedy(), lens, seed=11)
    ref_outs, _, _ = _reference(tiny_llama_dir, prompts, _greedy())
    outs, eng, proposer = _run_with_draft(tiny_llama_dir, prompts, _greedy(), 3, num_layers=1)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref_outs]
    draft = proposer.runner.model
    assert len(draft.model.layers) == 1 and len(eng.model.model.layers) == 2
    # weights shared with the target, not copied
    assert draft.model.layers[0] is eng.model.model.layers[0] and draft.lm_head is eng.model.lm_head
    assert draft.model.norm is eng.model.model.norm
    assert sorted(proposer.runner.kv_caches.layer_ids) == [0]
    assert eng.spec_stats.num_draft_tokens > 0
    _assert_all_blocks_free(eng)
    _assert_draft_blocks_free(proposer)


def test_self_draft_with_prefix_cache_and_preemption(tiny_llama_dir, vocab):
    kw = dict(block_size=4, num_kv_blocks=40, enable_prefix_caching=True)
    prompts = _tie_free_prompts(tiny_llama_dir, vocab, _greedy(), [3, 9, 17, 26, 30, 5, 12, 21], 8, seed=1)
    ref_outs, _, _ = _reference(tiny_llama_dir, prompts, _greedy(), **kw)
    llm = _make_llm(tiny_llama_dir, **kw)
    eng = llm.llm_engine
    eng.scheduler = recorder = CountingScheduler(eng.scheduler)
    proposer = _proposer(eng, 4, num_layers=1)
    eng.set_proposer(proposer, disable_by_batch_size=64)  # batch 8 here: drafts in every step
    assert proposer.runner.num_blocks == 40  # as many blocks as the target's cache
    outs = _generate(llm, prompts, _greedy())
    assert eng.spec_stats.num_proposer_errors == 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref_outs]
    assert recorder.num_preempted > 0 and eng.scheduler.prefix_cache_hits > 0
    assert proposer.runner.block_manager.prefix_cache_hits > 0  # the shared 8-token prefix, in the draft too
    _assert_all_blocks_free(eng)
    _assert_draft_blocks_free(proposer)
    # LLM.reset_prefix_cache forgets the draft's cached prefixes as well as the target's
    assert proposer.runner.block_manager.num_cached_blocks > 0 and eng.scheduler.num_cached_blocks > 0
    assert llm.reset_prefix_cache()
    assert proposer.runner.block_manager.num_cached_blocks == 0 and eng.scheduler.num_cached_blocks == 0


def test_full_draft_cache_drafts_for_the_sequences_that_fit(tiny_llama_dir, vocab):
    """9 blocks of 16 tokens hold one 128-token sequence: the others get no drafts, outputs are unchanged."""
    prompts = _tie_free_prompts(tiny_llama_dir, vocab, _greedy(), [30, 40, 35, 26], seed=5)
    ref_outs, _, _ = _reference(tiny_llama_dir, prompts, _greedy())
    llm = _make_llm(tiny_llama_dir)
    eng = llm.llm_engine
    proposer = _proposer(eng, 3, num_layers=1, num_kv_blocks=9)
    answered = []
    propose = proposer.propose

    def recording_propose(requests):
        drafts = propose(requests)
        answered.append((len(requests), len(drafts)))
        return drafts

    proposer.propose = recording_propose
    eng.set_proposer(proposer, disable_by_batch_size=64)  # batch 8 here: drafts in every step
    outs = _generate(llm, prompts, _greedy())
    assert eng.spec_stats.num_proposer_errors == 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref_outs]
    assert any(0 < got < asked for asked, got in answered)
    _assert_all_blocks_free(eng)
    _assert_draft_blocks_free(proposer)


def test_int8_self_draft_loads_the_target_again(tiny_llama_dir, vocab):
    prompts = _tie_free_prompts(tiny_llama_dir, vocab, _greedy(), [7, 19], seed=3)
    ref_outs, _, _ = _reference(tiny_llama_dir, prompts, _greedy())
    outs, eng, proposer = _run_with_draft(tiny_llama_dir, prompts, _greedy(), 3, quantization="int8")
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref_outs]
    draft = proposer.runner.model
    assert len(draft.model.layers) == 2 and draft.model.layers[0] is not eng.model.model.layers[0]
    assert draft.model.layers[0].mlp.down_proj.weight.dtype == torch.int8
    assert eng.spec_stats.num_accepted_draft_tokens > 0  # an int8 copy of the target mostly agrees with it
    _assert_draft_blocks_free(proposer)


@pytest.mark.parametrize("quantization", [None, "gguf"], ids=["gguf-dequantized", "gguf-native"])
def test_gguf_file_as_draft(tiny_llama_dir, vocab, tiny_tokenizer, tmp_path, monkeypatch, quantization):
    """The target's weights written as a Q8_0 .gguf (llama.cpp's layout and tokenizer) draft for it."""
    pytest.importorskip("gguf")
    transformers = pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "models"))
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    from test_gguf import Q, write_llama_gguf  # noqa: PLC0415  (the GGUF writer of the model tests)

    path = tmp_path / "tiny-q8_0.gguf"
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir)
    write_llama_gguf(path, hf, tiny_tokenizer, lambda name, gguf_name, a: Q.Q8_0 if a.ndim == 2 else Q.F32)
    prompts = _tie_free_prompts(tiny_llama_dir, vocab, _greedy(), [8, 21], seed=6)
    ref_outs, _, _ = _reference(tiny_llama_dir, prompts, _greedy())
    outs, eng, proposer = _run_with_draft(tiny_llama_dir, prompts, _greedy(), 4, model=str(path),
                                          quantization=quantization)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref_outs]
    method = type(proposer.runner.model.model.layers[0].mlp.down_proj.linear_method).__name__
    assert method == ("GGUFLinearMethod" if quantization == "gguf" else "UnquantizedLinearMethod")
    assert eng.spec_stats.acceptance_rate > 0.5  # Q8_0 of the target itself: nearly always right
    _assert_all_blocks_free(eng)
    _assert_draft_blocks_free(proposer)


def test_sampled_and_n_requests_free_every_draft_block(tiny_llama_dir, vocab):
    prompts = _prompts(vocab, lens=[6, 15], seed=8)
    params = SamplingParams(temperature=0.8, top_p=0.9, n=3, seed=5, max_tokens=12, ignore_eos=True)
    llm = _make_llm(tiny_llama_dir)
    eng = llm.llm_engine
    proposer = _proposer(eng, 2, num_layers=1)
    eng.set_proposer(proposer, disable_by_batch_size=64)  # batch 8 here: drafts in every step
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(len(c.token_ids) == 12 for o in outs for c in o.outputs)
    assert eng.spec_stats.num_proposer_errors == 0 and eng.spec_stats.num_draft_tokens > 0
    _assert_all_blocks_free(eng)
    _assert_draft_blocks_free(proposer)


# ---------------------------------------------------------------- the draft cache, call by call


def test_incremental_drafts_equal_fresh_drafts_after_rollbacks(tiny_llama_dir, vocab):
    """Random continuations (some drafts accepted, then a token of the target's own): the drafts of the
    proposer that keeps its cache equal those of a new proposer computing everything, and each sequence
    holds exactly the blocks for its committed tokens plus the drafts fed back."""
    llm = _make_llm(tiny_llama_dir, block_size=4)
    eng = llm.llm_engine
    k = 4
    kept = _proposer(eng, k, num_layers=1)
    rng = random.Random(0)
    seqs = {f"s{i}": (p, []) for i, p in enumerate(_prompts(vocab, lens=[5, 11, 2], seed=2))}
    for _ in range(8):
        requests = [DraftRequest(sid, p, list(out), rng.randint(1, k)) for sid, (p, out) in seqs.items()]
        drafts = kept.propose(requests)
        fresh = _proposer(eng, k, num_layers=1)
        assert drafts == fresh.propose(requests)
        for r in requests:
            assert len(drafts[r.seq_id]) == r.max_num_drafts
            table = kept.runner.block_manager.get_block_table(r.seq_id)
            assert len(table) == math.ceil((len(r.token_ids) + r.max_num_drafts - 1) / 4)
            accepted = drafts[r.seq_id][: rng.randint(0, r.max_num_drafts)]
            seqs[r.seq_id][1].extend(accepted + [rng.randrange(vocab)])
        fresh.release(r.seq_id for r in requests)
        _assert_draft_blocks_free(fresh)
    kept.release(seqs)
    _assert_draft_blocks_free(kept)


def test_idle_sequences_are_freed(tiny_llama_dir, vocab):
    llm = _make_llm(tiny_llama_dir)
    proposer = _proposer(llm.llm_engine, 2, num_layers=1)
    a, b = _prompts(vocab, lens=[9, 4], seed=4)
    proposer.propose([DraftRequest("a", a, [], 2), DraftRequest("b", b, [], 2)])
    assert proposer.num_tracked_seqs == 2
    proposer.release(["b", "unknown"])
    assert proposer.num_tracked_seqs == 1 and proposer.runner.block_manager.num_seqs == 1
    for _ in range(FREE_AFTER_IDLE_CALLS):  # "a" is not asked about any more (e.g. preempted)
        proposer.propose([])
    _assert_draft_blocks_free(proposer)
    # a reused seq id with other tokens starts over instead of reading the old cache
    first = proposer.propose([DraftRequest("a", a, [], 2)])["a"]
    assert proposer.propose([DraftRequest("a", b, [], 2)]) == _proposer(llm.llm_engine, 2, num_layers=1).propose(
        [DraftRequest("a", b, [], 2)])
    assert first == proposer.propose([DraftRequest("a", a, [], 2)])["a"]


# ---------------------------------------------------------------- through LLM(speculative_config=...)


def test_llm_speculative_config_draft_model(tiny_llama_dir, vocab):
    prompts = _tie_free_prompts(tiny_llama_dir, vocab, _greedy(), [6, 14], seed=9)
    ref_outs, _, _ = _reference(tiny_llama_dir, prompts, _greedy())
    llm = _make_llm(tiny_llama_dir, speculative_config={"method": "draft_model", "num_speculative_tokens": 3,
                                                         "model": str(tiny_llama_dir)})
    eng = llm.llm_engine
    assert isinstance(eng.proposer, DraftModelProposer) and "draft_model" in list_proposers()
    outs = _generate(llm, prompts, _greedy())
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref_outs]
    assert eng.spec_stats.acceptance_rate == 1.0
    _assert_all_blocks_free(eng)
    _assert_draft_blocks_free(eng.proposer)


# ---------------------------------------------------------------- (d) bad input


@pytest.fixture(scope="module")
def other_tokenizer_dir(tmp_path_factory, tiny_tokenizer, tiny_llama_dir):
    """The tiny Llama with two token ids of its tokenizer swapped: same vocab size, other tokenizer."""
    path = tmp_path_factory.mktemp("other-tokenizer")
    for f in tiny_llama_dir.iterdir():
        shutil.copy(f, path / f.name)
    tj = json.loads((path / "tokenizer.json").read_text())
    v = tj["model"]["vocab"]
    a, b = sorted(v, key=v.get)[100:102]
    v[a], v[b] = v[b], v[a]
    (path / "tokenizer.json").write_text(json.dumps(tj))
    return path


def test_bad_draft_configurations_are_refused(tiny_llama_dir, other_tokenizer_dir, tmp_path, tiny_tokenizer):
    eng = _make_llm(tiny_llama_dir).llm_engine
    small_vocab = write_tiny_llama(tmp_path / "small-vocab", tiny_tokenizer)
    cfg = json.loads((small_vocab / "config.json").read_text())
    cfg["vocab_size"] -= 1
    (small_vocab / "config.json").write_text(json.dumps(cfg))
    short = write_tiny_llama(tmp_path / "short", tiny_tokenizer, max_position_embeddings=64)
    cases = [
        ({"model": str(tmp_path / "missing")}, "does not exist"),
        ({"model": str(small_vocab)}, "vocab_size"),
        ({"model": str(other_tokenizer_dir)}, "different tokenizer"),
        ({"model": str(short)}, "max_position_embeddings"),
        ({"num_layers": 3}, r"num_layers must be in \[1, 2\]"),
        ({}, "needs num_layers"),
        ({"num_layers": 0}, "num_layers"),
        ({"num_layers": "1"}, "num_layers"),
        ({"model": 5}, "model must be a path"),
        ({"num_kv_blocks": -1}, "num_kv_blocks"),
        ({"num_layers": 1, "num_kv_blocks": 2}, "cannot hold one request"),
        ({"num_layers": 1, "prompt_lookup_max": 2}, "unknown keys"),
        ({"num_layers": 1, "dtype": "int4"}, "unsupported dtype"),
        ({"num_layers": 1, "quantization": "no-such-format"}, "unknown quantization method"),
    ]
    for options, match in cases:
        with pytest.raises(ValueError, match=match):
            _proposer(eng, 2, **options)
