"""Multi-head latent attention (DeepSeek-V2/V3) over a paged `LatentKVCache`, for every attention backend.

MLA caches one vector per token, `latent = [kv_a_layernorm(c_kv) (kv_lora_rank) | roped k_pe (rope dims)]`,
and derives each head's key and value from it with kv_b_proj's rows `W_UK [H, d_nope, r]`, `W_UV [H, d_v, r]`:

    k_h = [W_UK_h c | k_pe],  v_h = W_UV_h c,  scores_h = scale * (q_nope_h . W_UK_h c + q_pe_h . k_pe)

Two equal ways to compute it (mla_forward picks per request):
- prefill chunks, expanded: the request's whole context latent (cached + this chunk) gathered through its
  block table, kv_b_proj applied, causal attention of the chunk's queries (k/v per head, as transformers).
- decodes, absorbed: q_lat_h = W_UK_h^T q_nope_h, so scores_h = scale * [q_lat_h | q_pe_h] . latent; attention
  over the latent cache as one-KV-head attention (ops.mla.paged_mla_decode), then W_UV per head. A decode
  reads only the latent cache, L values per token instead of H * (d_k + d_v).

The step's batch comes from `attn_backend.metadata` (decodes first, as for every backend); the backend's
K/V kernels are not used. The decode path makes the same op calls every step and reads no tensor data into
Python, so decode-only steps stay replayable as step graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagellm.attention.base import AttentionMetadata
from pagellm.kv_cache import LatentKVCache
from pagellm.ops import mla as mla_ops
from pagellm.ops.mla_reference import gather_latent


@dataclass(frozen=True)
class MLALayerSpec:
    """Static per-layer MLA parameters. scale: softmax scale (YaRN's mscale folded in)."""

    layer_idx: int
    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    scale: float

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


def mla_forward(spec: MLALayerSpec, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                kv_b_weight: torch.Tensor, kv_cache: LatentKVCache, md: AttentionMetadata) -> torch.Tensor:
    """Write this step's latent rows into `kv_cache`, then attend.

    q_nope: [T, H, d_nope]; q_pe: [T, H, d_rope] (roped); latent: [T, L] (normed c_kv | roped k_pe);
    kv_b_weight: kv_b_proj's weight [H * (d_nope + d_v), kv_lora_rank]; md: the step's metadata.
    Returns [T, H, d_v]: causal attention of each token over its request's context (rows past
    md.num_tokens, padding, are zero).
    """
    if not isinstance(kv_cache, LatentKVCache):
        raise TypeError(f"MLA layer {spec.layer_idx} needs a LatentKVCache, got {type(kv_cache).__name__}")
    if kv_cache.is_quantized:
        raise NotImplementedError(f"MLA over a quantized latent cache ({kv_cache.spec.dtype!r}) is not supported")
    n, nd = md.num_tokens, md.num_decode_reqs
    H, dn, dv, r = spec.num_heads, spec.qk_nope_head_dim, spec.v_head_dim, spec.kv_lora_rank
    w_kv = kv_b_weight.view(H, dn + dv, r)
    w_uk, w_uv = w_kv[:, :dn], w_kv[:, dn:]
    mla_ops.write_latent(kv_cache.cache, latent[:n], md.slot_mapping)
    if nd == n == q_nope.shape[0]:  # decode-only, the common (and graph-captured) step: no slicing
        return _absorbed_decode(spec, q_nope, q_pe, w_uk, w_uv, kv_cache.cache, md.block_tables, md.seq_lens)
    out = q_nope.new_zeros((q_nope.shape[0], H, dv))
    if nd:
        out[:nd] = _absorbed_decode(spec, q_nope[:nd], q_pe[:nd], w_uk, w_uv, kv_cache.cache,
                                    md.block_tables[:nd], md.seq_lens[:nd])
    if md.num_reqs > nd:
        _expanded_prefill(spec, out, q_nope, q_pe, kv_b_weight, kv_cache.cache, md)
    return out


def _absorbed_decode(spec: MLALayerSpec, q_nope, q_pe, w_uk, w_uv, cache, block_tables, seq_lens) -> torch.Tensor:
    """[T, H, d_v] for T decode tokens: W_UK folded into the query, W_UV applied to the latent result."""
    # a contiguous [H, T, d_nope] copy (small) keeps ATen's bf16 bmm on its fast path
    q_lat = torch.bmm(q_nope.transpose(0, 1).contiguous(), w_uk).transpose(0, 1)  # [T, H, r]
    query = torch.cat([q_lat, q_pe], dim=-1)                                      # [T, H, L]
    o_lat = mla_ops.paged_mla_decode(query, cache, block_tables, seq_lens, spec.scale, spec.kv_lora_rank)
    return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, d_v]


def _expanded_prefill(spec: MLALayerSpec, out, q_nope, q_pe, kv_b_weight, cache, md: AttentionMetadata) -> None:
    """out[chunk] for every prefill request: its context latent expanded to per-head k / v (as transformers)."""
    nd, r = md.num_decode_reqs, spec.kv_lora_rank
    starts = md.query_start_loc.tolist()
    seq_lens = md.seq_lens.tolist()
    for i in range(nd, md.num_reqs):
        qs, qe, seq_len = starts[i], starts[i + 1], seq_lens[i]
        ctx = gather_latent(cache, md.block_tables[i], seq_len)                 # [S, L]
        kv = F.linear(ctx[:, :r], kv_b_weight).view(seq_len, spec.num_heads, -1)   # [S, H, dn + dv]
        k_nope, v = kv.split([spec.qk_nope_head_dim, spec.v_head_dim], dim=-1)
        k_pe = ctx[:, None, r:].expand(-1, spec.num_heads, -1)
        k = torch.cat([k_nope, k_pe], dim=-1).transpose(0, 1)                   # [H, S, dk]
        q = torch.cat([q_nope[qs:qe], q_pe[qs:qe]], dim=-1).transpose(0, 1)     # [H, n, dk]
        scores = torch.matmul(q, k.transpose(1, 2)) * spec.scale               # [H, n, S]
        q_pos = torch.arange(seq_len - (qe - qs), seq_len, device=q.device)
        future = torch.arange(seq_len, device=q.device)[None, :] > q_pos[:, None]
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
        out[qs:qe] = torch.matmul(probs, v.transpose(0, 1)).transpose(0, 1)
