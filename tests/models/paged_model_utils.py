"""Test helpers: tiny random HF models, a paged-KV runner for pagellm models, and HF references."""

from __future__ import annotations

import math
import random

import torch

from pagellm.attention.base import AttentionMetadata, BaseAttentionBackend
from pagellm.kv_cache import KVCacheConfig, allocate_kv_caches, group_kv_cache_specs
from pagellm.forward_context import ForwardContext


# ---------------------------------------------------------------------------------------------
# attention backends
class RefPagedBackend(BaseAttentionBackend):
    """Slow, obviously-correct paged attention (test-local reference)."""

    name = "test-ref"

    def forward(self, layer, query, key, value, kv_cache):
        md = self.metadata
        key_cache, value_cache = kv_cache.key_cache, kv_cache.value_cache
        bs = key_cache.shape[2]
        slots = md.slot_mapping
        keep = slots >= 0
        blk, off = slots[keep] // bs, slots[keep] % bs
        key_cache[blk, :, off] = key[keep]
        value_cache[blk, :, off] = value[keep]
        out = torch.empty_like(query)
        rep = layer.num_heads // layer.num_kv_heads
        qsl = md.query_start_loc.tolist()
        for r in range(md.num_reqs):
            qs, qe = qsl[r], qsl[r + 1]
            L = int(md.seq_lens[r])
            nb = (L + bs - 1) // bs
            ids = md.block_tables[r, :nb].long()
            K = key_cache[ids].permute(0, 2, 1, 3).reshape(nb * bs, layer.num_kv_heads, -1)[:L]
            V = value_cache[ids].permute(0, 2, 1, 3).reshape(nb * bs, layer.num_kv_heads, -1)[:L]
            K = K.repeat_interleave(rep, dim=1)
            V = V.repeat_interleave(rep, dim=1)
            q = query[qs:qe]
            qpos = torch.arange(L - (qe - qs), L)[:, None]
            kpos = torch.arange(L)[None, :]
            mask = kpos <= qpos
            if layer.window_size > 0:
                mask &= kpos > qpos - layer.window_size
            s = torch.einsum("qhd,khd->hqk", q, K) * layer.scale
            if layer.softcap > 0:
                s = layer.softcap * torch.tanh(s / layer.softcap)
            s = s.masked_fill(~mask[None], float("-inf"))
            p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
            out[qs:qe] = torch.einsum("hqk,khd->qhd", p, V)
        return out


def available_backends() -> list[str]:
    """Registered backends usable on CPU ('torch', 'cpu'); the test-local reference if none is."""
    names = []
    try:
        from pagellm.attention import get_attention_backend_cls, list_attention_backends

        for n in ("torch", "cpu"):
            if n in list_attention_backends() and get_attention_backend_cls(n).is_available(torch.device("cpu"))[0]:
                names.append(n)
    except Exception:
        pass
    return names or ["test-ref"]


def make_backend(name: str) -> BaseAttentionBackend:
    if name == "test-ref":
        return RefPagedBackend(torch.device("cpu"))
    from pagellm.attention import get_attention_backend_cls

    return get_attention_backend_cls(name)(torch.device("cpu"))


# ---------------------------------------------------------------------------------------------
# paged runner
class PagedRunner:
    """Drives a pagellm model with a paged KV cache: random block assignment, decodes-first batches."""

    def __init__(self, model, backend: BaseAttentionBackend, block_size: int, max_tokens_per_req: int,
                 max_reqs: int, seed: int = 0) -> None:
        self.model = model
        self.backend = backend
        self.bs = block_size
        blocks_per_req = (max_tokens_per_req + block_size - 1) // block_size
        num_blocks = blocks_per_req * max_reqs + 3
        dtype = getattr(model, "dtype", None) or next(p.dtype for p in model.parameters() if p.is_floating_point())
        specs = model.kv_cache_specs(block_size, dtype)
        config = KVCacheConfig(num_blocks=num_blocks, groups=group_kv_cache_specs(specs), layer_specs=specs)
        self.kv_caches = allocate_kv_caches(config, torch.device("cpu"))
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self.max_blocks = blocks_per_req

    def step(self, work: list[tuple[int, list[int]]]) -> torch.Tensor:
        """work: (req_id, new tokens), decodes (1 token, existing req) first. Returns last-token hidden [R, H]
        and stores all-token hidden in self.last_hidden."""
        ids, pos, slots, qsl, seq_lens, tables = [], [], [], [0], [], []
        num_decode = 0
        for i, (rid, toks) in enumerate(work):
            start = self.lens.get(rid, 0)
            if start > 0 and len(toks) == 1:
                assert num_decode == i, "decodes must come first"
                num_decode += 1
            table = self.tables.setdefault(rid, [])
            end = start + len(toks)
            while len(table) * self.bs < end:
                table.append(self.free.pop())
            for j, t in enumerate(toks):
                p = start + j
                ids.append(t)
                pos.append(p)
                slots.append(table[p // self.bs] * self.bs + p % self.bs)
            self.lens[rid] = end
            qsl.append(qsl[-1] + len(toks))
            seq_lens.append(end)
            tables.append(table + [0] * (self.max_blocks - len(table)))
        md = AttentionMetadata(
            num_reqs=len(work), num_tokens=len(ids), num_decode_reqs=num_decode,
            max_query_len=max(len(t) for _, t in work), max_seq_len=max(seq_lens),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        )
        self.backend.plan(md)
        ctx = ForwardContext(attn_backend=self.backend, kv_caches=self.kv_caches)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), ctx)
        self.last_hidden = hidden
        last = torch.tensor(qsl[1:]) - 1
        return hidden[last]


def paged_prompt_logprobs(model, backend, prompts: list[list[int]], block_size: int, seed: int = 0):
    """log_softmax of the logits at every prompt position, all prompts in one prefill batch."""
    runner = PagedRunner(model, backend, block_size, max(map(len, prompts)), len(prompts), seed)
    runner.step(list(enumerate(prompts)))
    with torch.inference_mode():
        logits = model.compute_logits(runner.last_hidden)
    out, s = [], 0
    for p in prompts:
        out.append(torch.log_softmax(logits[s:s + len(p)].float(), dim=-1))
        s += len(p)
    return out


def paged_greedy(model, backend, prompts: list[list[int]], max_new_tokens: int, block_size: int, seed: int = 0,
                 return_logprobs: bool = False):
    """Greedy decoding; all but the last prompt prefill in step 1, the last joins step 2 as a prefill
    next to the others' decodes (a mixed batch). Returns generated token lists (and per-step logprobs)."""
    n = len(prompts)
    runner = PagedRunner(model, backend, block_size, max(map(len, prompts)) + max_new_tokens + 1, n, seed)
    gen: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[torch.Tensor]] = [[] for _ in range(n)]
    started = [False] * n

    def take(rids, hidden):
        with torch.inference_mode():
            logits = model.compute_logits(hidden)
        for rid, row in zip(rids, logits):
            if len(gen[rid]) < max_new_tokens:
                gen[rid].append(int(row.argmax()))
                lps[rid].append(torch.log_softmax(row.float(), -1))

    first = list(range(n - 1)) if n > 1 else [0]
    take(first, runner.step([(r, prompts[r]) for r in first]))
    for r in first:
        started[r] = True
    while any(len(g) < max_new_tokens for g in gen):
        work, rids = [], []
        for r in range(n):
            if started[r] and len(gen[r]) < max_new_tokens:
                work.append((r, [gen[r][-1]]))
                rids.append(r)
        for r in range(n):
            if not started[r]:
                work.append((r, prompts[r]))
                rids.append(r)
                started[r] = True
        take(rids, runner.step(work))
    return (gen, lps) if return_logprobs else gen


# ---------------------------------------------------------------------------------------------
# tiny HF models
def randomize_(hf_model, seed: int = 0, scale: float = 0.08) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=g))


def make_tiny_hf(config_cls, model_cls, seed: int = 0, **overrides):
    kw = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
              bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    kw.update(overrides)
    config = config_cls(**kw)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    randomize_(model, seed)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model


def hf_prompt_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), -1)


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_greedy_batch(hf_model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF `generate` greedy for several prompts at once (left padding + attention mask)."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        out = hf_model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[:, width:].tolist()


def random_prompts(lengths, vocab: int, seed: int = 0) -> list[list[int]]:
    g = random.Random(seed)
    return [[g.randrange(vocab) for _ in range(n)] for n in lengths]
