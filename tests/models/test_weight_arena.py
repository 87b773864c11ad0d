"""The CPU weight arena (model_loader/weight_arena.py): values and tensor identity kept, one storage in module
order, views of shared storages left alone, the huge-page advice reaching the kernel, PAGELLM_WEIGHT_ARENA
parsed (and refused) before loading, and a model generating the same tokens and logprobs packed or not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pagellm import LLM, SamplingParams
from pagellm.model_loader import build_model, open_model, weight_arena
from pagellm.model_loader.weight_arena import HUGE_PAGE_BYTES, WEIGHT_ARENA_ENV, arena_mode, pack_weights

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


class _Toy(nn.Module):
    def __init__(self, big: int = 37) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = nn.Parameter(torch.randn(big, 13, generator=g).to(torch.bfloat16), requires_grad=False)
        self.head = nn.Linear(13, big, bias=False)
        self.head.weight = self.emb  # tied: one parameter object reached twice
        self.w = nn.Parameter(torch.randn(7, 5, generator=g), requires_grad=False)
        self.ids = nn.Parameter(torch.arange(11, dtype=torch.int32), requires_grad=False)
        base = torch.randn(6, 4, generator=g)
        self.a = nn.Parameter(base[:3], requires_grad=False)  # two views of one storage: left where they are
        self.b = nn.Parameter(base[3:], requires_grad=False)
        self.register_buffer("cos", torch.randn(9, generator=g).double())


def test_pack_keeps_values_and_identity_in_one_storage():
    toy = _Toy()
    before = {n: (p, p.detach().clone()) for n, p in list(toy.named_parameters()) + list(toy.named_buffers())}
    shared_ptr = toy.a.untyped_storage().data_ptr()
    moved = pack_weights(toy, huge_pages=False)
    after = dict(list(toy.named_parameters()) + list(toy.named_buffers()))
    for name, (obj, value) in before.items():
        assert after[name] is obj  # the same tensor objects: modules and graphs holding them see the move
        assert torch.equal(obj, value) and obj.dtype == value.dtype and obj.shape == value.shape
    packed = [toy.emb, toy.w, toy.ids, toy.cos]
    storages = {t.untyped_storage().data_ptr() for t in packed}
    assert len(storages) == 1
    assert toy.head.weight is toy.emb
    assert all(t.data_ptr() % 64 == 0 for t in packed)
    assert [t.data_ptr() for t in packed] == sorted(t.data_ptr() for t in packed)  # module order
    assert moved >= sum(t.numel() * t.element_size() for t in packed)
    assert toy.a.untyped_storage().data_ptr() == toy.b.untyped_storage().data_ptr() == shared_ptr


def test_pack_nothing_to_move():
    assert pack_weights(nn.Module()) == 0


def _vm_flags(addr: int) -> str:
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return line
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                    reason="transparent huge pages unavailable on this kernel (or set to never)")
def test_huge_pages_advised_on_the_arena(monkeypatch):
    toy = _Toy(big=6 * HUGE_PAGE_BYTES // (13 * 2))  # a ~6 MiB parameter: whole 2 MiB pages inside the arena
    pack_weights(toy, huge_pages=True)
    ptr = toy.emb.data_ptr()
    aligned = -(-ptr // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    assert " hg" in _vm_flags(aligned)  # VM_HUGEPAGE: what madvise(MADV_HUGEPAGE) sets
    # The control: huge_pages=False advises nothing. (Not read from VmFlags: once retain_heap has raised glibc's
    # mmap threshold, arenas this small come from the malloc heap, and the control's can land in the hole the first
    # toy's freed parameters left just below the advised arena, so its first 2 MiB boundary can fall inside the
    # advised range. Seen in the full suite.)
    advised = []
    monkeypatch.setattr(weight_arena, "advise_huge_pages", lambda p, n: advised.append((p, n)) or n)
    toy2 = _Toy(big=6 * HUGE_PAGE_BYTES // (13 * 2))
    pack_weights(toy2, huge_pages=False)
    assert advised == []
    pack_weights(_Toy(big=6 * HUGE_PAGE_BYTES // (13 * 2)), huge_pages=True)
    assert len(advised) == 1 and advised[0][1] > 0  # the spy sees the call the control lacks


@pytest.mark.parametrize("value, mode", [("1", "huge"), ("", "huge"), ("nohuge", "nohuge"), ("0", "off"),
                                         ("OFF", "off")])
def test_arena_mode(value, mode):
    assert arena_mode({WEIGHT_ARENA_ENV: value}) == mode
    assert arena_mode({}) == "huge"


def test_bad_env_refused_before_loading(monkeypatch, tiny_llama_dir):
    monkeypatch.setenv(WEIGHT_ARENA_ENV, "yes")
    with pytest.raises(ValueError, match="PAGELLM_WEIGHT_ARENA"):
        build_model(open_model(str(tiny_llama_dir)), dtype="float32")


def test_packed_model_same_outputs(monkeypatch, tiny_llama_dir):
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
    runs = {}
    for mode in ("0", "1"):
        monkeypatch.setenv(WEIGHT_ARENA_ENV, mode)
        llm = LLM(str(tiny_llama_dir), max_model_len=64, num_kv_blocks=64, dtype="bfloat16")
        model = llm.llm_engine.model
        ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        assert (len(ptrs) == 1) == (mode == "1")
        out = llm.generate(["hello world", "def main():"], params, use_tqdm=False)
        runs[mode] = [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in d.items()}
                                                       for d in o.outputs[0].logprobs]) for o in out]
    assert runs["0"] == runs["1"]


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                    reason="transparent huge pages unavailable on this kernel (or set to never)")
def test_sleep_level2_round_trip_keeps_huge_pages(monkeypatch):
    from pagellm.engine.sleep import put_to_sleep, wake_from_sleep

    monkeypatch.delenv(WEIGHT_ARENA_ENV, raising=False)
    toy = _Toy(big=6 * HUGE_PAGE_BYTES // (13 * 2))
    pack_weights(toy, huge_pages=True)
    tensors = list(toy.parameters()) + list(toy.buffers())
    saved = [t.detach().clone() for t in tensors]
    state = put_to_sleep(2, [], tensors, torch.device("cpu"))
    assert toy.emb.untyped_storage().nbytes() == 0  # the arena was really freed
    wake_from_sleep(state)
    assert all(torch.equal(t, s) for t, s in zip(tensors, saved))
    ptr = toy.emb.data_ptr()
    assert " hg" in _vm_flags(-(-ptr // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES)
