"""LLM.sleep / wake_up: round trips give identical outputs, the KV cache (and at level 2 the weights) is really
freed (process RSS drops by about its size), and sleeping is refused with requests unfinished, generating
while asleep raises EngineSleepingError."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.engine.maintenance import EngineSleepingError
from pagellm.engine.sleep import rss_bytes

PROMPTS = ["hello world", "def main():"]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)
NUM_KV_BLOCKS = 12000  # 2 layers x K/V x 12000 blocks x 16 tokens x 2 heads x 16 dims x 4 B ~ 94 MiB


def _outputs(llm: LLM):
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


def _kv_bytes(llm: LLM) -> int:
    return sum(t.untyped_storage().nbytes() for t in llm.llm_engine.kv_caches.tensors())


def _weight_bytes(llm: LLM) -> int:
    model = llm.llm_engine.model
    return sum(t.untyped_storage().nbytes() for t in {p.untyped_storage().data_ptr(): p for p in
                                                       list(model.parameters()) + list(model.buffers())}.values())


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=NUM_KV_BLOCKS, max_model_len=128)


@pytest.mark.parametrize("level", [1, 2])
def test_round_trip_same_outputs_and_memory_freed(llm, level):
    before = _outputs(llm)
    kv = _kv_bytes(llm)
    assert kv > 80 * 2**20
    weights = _weight_bytes(llm)
    rss0 = rss_bytes()
    result = llm.sleep(level=level)
    rss1 = rss_bytes()
    assert llm.is_sleeping and result["level"] == level
    assert _kv_bytes(llm) == 0  # the storages are really gone, not just unreferenced
    # RSS fell by at least most of the KV cache (allocator slack and other threads allowed for)
    assert rss0 - rss1 > 0.8 * kv
    assert result["freed_bytes"] > 0.8 * kv
    if level == 2:
        assert _weight_bytes(llm) < 0.05 * weights  # all but tiny non-resizable buffers, saved to disk
    llm.wake_up()
    assert not llm.is_sleeping and _kv_bytes(llm) == kv
    assert _outputs(llm) == before


def test_generate_while_asleep_is_refused(llm):
    llm.sleep()
    try:
        with pytest.raises(EngineSleepingError, match="wake_up"):
            llm.generate("hello", GREEDY, use_tqdm=False)
        with pytest.raises(EngineSleepingError):
            llm.update_weights([])
        with pytest.raises(EngineSleepingError):
            llm.sleep()
        assert not llm.llm_engine.has_unfinished_requests()
    finally:
        llm.wake_up()
    llm.wake_up()  # awake already: a no-op
    assert len(_outputs(llm)) == len(PROMPTS)


def test_sleep_refused_with_requests_running(llm):
    engine = llm.llm_engine
    engine.add_request("r0", "hello", SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="unfinished"):
        llm.sleep()
    assert not llm.is_sleeping and _kv_bytes(llm) > 0
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("level", [0, 3, True, "1"])
def test_bad_level(llm, level):
    with pytest.raises(ValueError, match="one of"):
        llm.sleep(level=level)
    assert not llm.is_sleeping


# ---------------------------------------------------------------- a draft model's own KV cache
def _draft_kv_bytes(llm: LLM) -> int:
    return sum(t.untyped_storage().nbytes() for t in llm.llm_engine.proposer.runner.kv_caches.tensors())


def _draft_weight_bytes(llm: LLM) -> int:
    return _storage_bytes(llm.llm_engine.proposer.runner.model)


def _storage_bytes(model) -> int:
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in tensors}.values())


@pytest.fixture(scope="module")
def draft_llm(tiny_llama_dir):
    """The tiny model drafting for itself from its own checkpoint (its own weights): every draft is accepted
    while the draft's weights and cache are intact. The draft's cache is the big one here."""
    return LLM(str(tiny_llama_dir), num_kv_blocks=64, max_model_len=128, speculative_config={
        "method": "draft_model", "num_speculative_tokens": 3, "model": str(tiny_llama_dir),
        "num_kv_blocks": NUM_KV_BLOCKS, "disable_by_batch_size": 64, "adaptive": False})  # always draft


def _accepted_fraction(llm: LLM) -> float:
    stats = llm.llm_engine.spec_stats
    drafts0, accepted0 = stats.num_draft_tokens, stats.num_accepted_draft_tokens
    _outputs(llm)
    drafts, accepted = stats.num_draft_tokens - drafts0, stats.num_accepted_draft_tokens - accepted0
    assert drafts > 0
    return accepted / drafts


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_draft_models_kv_cache(draft_llm, level):
    llm = draft_llm
    before = _outputs(llm)
    assert _accepted_fraction(llm) > 0.8  # all, but for a near-tie argmax between batch shapes
    draft_kv, draft_weights = _draft_kv_bytes(llm), _draft_weight_bytes(llm)
    assert draft_kv > 80 * 2**20 and draft_kv > 20 * _kv_bytes(llm)  # most of what sleep frees is the draft's
    rss0 = rss_bytes()
    result = llm.sleep(level=level)
    assert rss0 - rss_bytes() > 0.8 * draft_kv and result["freed_bytes"] > 0.8 * draft_kv
    assert _draft_kv_bytes(llm) == 0 and _kv_bytes(llm) == 0
    if level == 2:
        assert _draft_weight_bytes(llm) < 0.05 * draft_weights
    llm.wake_up()
    assert _draft_kv_bytes(llm) == draft_kv and _draft_weight_bytes(llm) == draft_weights
    assert _outputs(llm) == before
    assert _accepted_fraction(llm) > 0.8  # the draft's weights and cache work again (outputs are lossless anyway)


def test_self_draft_shares_the_targets_weights_through_level_2(tiny_llama_dir):
    """A self-draft's layers are the target's modules: level 2 saves and frees them once (the target's worker),
    the draft frees its own KV cache, and after wake both work: same outputs, same drafts accepted."""
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, max_model_len=128, speculative_config={
        "method": "draft_model", "num_speculative_tokens": 3, "num_layers": 1, "num_kv_blocks": 256,
        "disable_by_batch_size": 64, "adaptive": False})  # always draft: a draft as big as its target never pays
    assert llm.llm_engine.proposer.runner.model.model.embed_tokens is llm.llm_engine.model.model.embed_tokens
    before, accepted = _outputs(llm), _accepted_fraction(llm)
    draft_kv, weights = _draft_kv_bytes(llm), _weight_bytes(llm)
    llm.sleep(level=2)
    assert _draft_kv_bytes(llm) == 0 and _weight_bytes(llm) < 0.05 * weights
    assert _draft_weight_bytes(llm) < 0.05 * weights  # the shared modules: freed by the target's worker
    llm.wake_up()
    assert _draft_kv_bytes(llm) == draft_kv and _weight_bytes(llm) == weights
    assert _outputs(llm) == before and _accepted_fraction(llm) == accepted
