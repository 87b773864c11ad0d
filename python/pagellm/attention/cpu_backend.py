"""The `cpu` attention backend: the C++ ops (torch.ops.pagellm.*) on CPU tensors.

Decodes (the first num_decode_reqs requests, one token each) go through paged_attention_decode
(flash-decoding), long prefill chunks through paged_attention_prefill; both write into one preallocated
output.

Batch invariance: a row of at most MULTI_QUERY_MAX_LEN new tokens (a speculative verify row of 1 + k tokens,
a short prompt or chunk) also goes through the decode kernel, one query per token with that token's own
context length ("multi-query decode"). A token at position p then gets exactly the bits a plain decode of p
gets: the same key tiles and partitions, the same online-softmax order (the decode kernel's partitions are
a function of the query's position alone), so greedy speculative decoding matches plain decoding in bf16.
"""

from __future__ import annotations

import torch

from pagellm import ops
from pagellm.attention.base import AttentionLayerSpec, AttentionMetadata
from pagellm.attention.registry import register_attention_backend
from pagellm.attention.torch_backend import PagedBackendBase
from pagellm.kv_cache import PagedKVCache

# Rows with up to this many new tokens attend through the decode kernel, one query per token; the kernel
# recognises a row's consecutive queries and reads each key tile once for all of them
# (decode_runs_cpu_kernels.h), so verify rows (1 + k <= 16) and short prompts cost little beyond their arithmetic.
MULTI_QUERY_MAX_LEN = 16


class _MultiQueryPlan:
    """A non-decode step's tokens split into those attended one query at a time through the decode kernel
    (rows of <= MULTI_QUERY_MAX_LEN tokens, decodes included) and the long prefill rows.

    token_ids:      int64 [num_short_tokens]  the short rows' tokens (None: all tokens, 0..num_tokens)
    block_tables:   int32 [num_short_tokens, max_blocks]  each token's row's block table
    seq_lens:       int32 [num_short_tokens]  each token's position + 1 (the context a decode of it sees)
    long_token_ids: int64 [num_long_tokens]  the long rows' tokens, in order (None when there are none)
    long_*:         the prefill call's per-row arguments over those rows (query_start_loc over the gathered tokens)
    """

    def __init__(self, md: AttentionMetadata) -> None:
        r = md.num_reqs
        qsl = md.query_start_loc[: r + 1].to(torch.int64)
        q_lens = qsl[1:] - qsl[:-1]
        short_rows = q_lens <= MULTI_QUERY_MAX_LEN
        row_of_token = torch.repeat_interleave(torch.arange(r), q_lens)
        short_tok = short_rows[row_of_token]
        offset = torch.arange(md.num_tokens) - qsl[row_of_token]  # token's index inside its row
        seq_lens = md.seq_lens[:r].to(torch.int64)
        tok_lens = (seq_lens[row_of_token] - q_lens[row_of_token] + offset + 1).to(torch.int32)
        all_short = bool(short_rows.all())
        self.token_ids = None if all_short else short_tok.nonzero().flatten()
        rows = row_of_token if all_short else row_of_token[self.token_ids]
        self.block_tables = md.block_tables.index_select(0, rows)
        self.seq_lens = tok_lens if all_short else tok_lens[self.token_ids]
        self.long_token_ids = None
        # The usual mixed step (decodes and short rows first, then long prefill rows): both parts are one
        # contiguous token range, so the kernels read q and write out through views instead of gathered copies
        # (two [num_tokens, heads, head_dim] copies per layer, ~10 % of a 2048-token prefill step).
        self.num_short_first = None
        if not all_short:
            num_short = int(short_tok.sum())
            if num_short == 0 or bool(short_tok[:num_short].all()):
                self.num_short_first = num_short
            long_rows = (~short_rows).nonzero().flatten()
            self.long_token_ids = (~short_tok).nonzero().flatten()
            self.long_block_tables = md.block_tables.index_select(0, long_rows)
            self.long_seq_lens = md.seq_lens.index_select(0, long_rows)
            starts = torch.zeros(long_rows.numel() + 1, dtype=torch.int64)
            starts[1:] = torch.cumsum(q_lens[long_rows], 0)
            self.long_query_start_loc = starts.to(torch.int32)


@register_attention_backend("cpu")
class CpuAttentionBackend(PagedBackendBase):
    """C++ paged attention on CPU (AVX-512 when built for it); float, int8 and fp8 KV caches (PagedBackendBase.forward)."""

    @classmethod
    def is_available(cls, device: torch.device) -> tuple[bool, str]:
        if torch.device(device).type != "cpu":
            return False, f"the cpu backend runs on CPU tensors only, not {torch.device(device)}"
        return ops.ops_available()

    # The registered overloads, not the validating pagellm.ops wrappers: forward() runs once per layer
    # per step, and the C++ glue checks every argument anyway.
    if ops.ops_available()[0]:
        _write = staticmethod(torch.ops.pagellm.reshape_and_cache.default)
        _decode = staticmethod(torch.ops.pagellm.paged_attention_decode.default)
        _prefill = staticmethod(torch.ops.pagellm.paged_attention_prefill.default)
        _write_quantized = staticmethod(torch.ops.pagellm.reshape_and_cache_quantized.default)
        _decode_quantized = staticmethod(torch.ops.pagellm.paged_attention_decode_quantized.default)
        _prefill_quantized = staticmethod(torch.ops.pagellm.paged_attention_prefill_quantized.default)

    def plan(self, metadata: AttentionMetadata) -> None:
        """Decode-only steps (the ones replayed as step graphs) plan exactly as PagedBackendBase; other steps
        whose rows include a short one also build the multi-query decode arguments (reads the metadata)."""
        super().plan(metadata)
        self._multi_query = None
        if metadata.num_reqs > metadata.num_decode_reqs and metadata.num_tokens > 0:
            self._multi_query = _MultiQueryPlan(metadata)

    def forward(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        mq = getattr(self, "_multi_query", None)
        if mq is None or self.metadata is None or not isinstance(kv_cache, PagedKVCache):
            return super().forward(layer, query, key, value, kv_cache)  # it also raises for bad calls
        if kv_cache.k_scale is None:
            caches = (kv_cache.key_cache, kv_cache.value_cache)
            write, decode, prefill = self._write, self._decode, self._prefill
        else:
            caches = (kv_cache.key_cache, kv_cache.value_cache, kv_cache.k_scale, kv_cache.v_scale)
            write, decode, prefill = self._write_quantized, self._decode_quantized, self._prefill_quantized
        n = self.metadata.num_tokens
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if query.shape[0] > n:
            out[n:].zero_()  # padded tokens
        q, o = query[:n], out[:n]
        if key is not None:  # None: a layer sharing another layer's cache, which wrote it already
            write(*caches, key[:n], value[:n], self.metadata.slot_mapping)
        args = (layer.scale, layer.window_size, layer.softcap)
        if mq.token_ids is None:  # every row short: one decode call, one query per token
            decode(o, q, *caches, mq.block_tables, mq.seq_lens, *args)
            return out
        if mq.num_short_first is not None:  # [short tokens | long tokens]: views, no gather / scatter
            k = mq.num_short_first
            if k:
                decode(o[:k], q[:k], *caches, mq.block_tables, mq.seq_lens, *args)
            prefill(o[k:], q[k:], *caches, mq.long_block_tables, mq.long_query_start_loc, mq.long_seq_lens, *args)
            return out
        short_out = torch.empty((mq.token_ids.numel(),) + q.shape[1:], dtype=q.dtype)
        decode(short_out, q.index_select(0, mq.token_ids), *caches, mq.block_tables, mq.seq_lens, *args)
        o.index_copy_(0, mq.token_ids, short_out)
        long_out = torch.empty((mq.long_token_ids.numel(),) + q.shape[1:], dtype=q.dtype)
        prefill(long_out, q.index_select(0, mq.long_token_ids), *caches, mq.long_block_tables,
                mq.long_query_start_loc, mq.long_seq_lens, *args)
        o.index_copy_(0, mq.long_token_ids, long_out)
        return out

    @property
    def step_graph_safe(self) -> bool:
        """The registered C++ ops only read the metadata tensors (decode-only steps, the replayed ones, plan
        nothing of their own); a subclass that overrides plan() or forward() or binds other kernels (a Python
        reference, say) may read data, so it must say so itself."""
        cls = type(self)
        op = torch.ops.pagellm if ops.ops_available()[0] else None
        return bool(op is not None and cls.forward is CpuAttentionBackend.forward
                    and cls.plan is CpuAttentionBackend.plan
                    and cls._write is op.reshape_and_cache.default
                    and cls._decode is op.paged_attention_decode.default
                    and cls._prefill is op.paged_attention_prefill.default
                    and cls._write_quantized is op.reshape_and_cache_quantized.default
                    and cls._decode_quantized is op.paged_attention_decode_quantized.default
                    and cls._prefill_quantized is op.paged_attention_prefill_quantized.default)
