"""LLMEngine: the streaming core. One `step()` = schedule -> execute -> update.

    engine = LLMEngine.from_engine_args(EngineArgs(model=...))
    engine.add_request("r0", "Hello", SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        for out in engine.step():      # RequestOutputs that changed this step
            print(out.outputs[0].text)

The C++ scheduler owns batching and the KV blocks; Python owns the model, sampling and every stop
decision (passed back to the scheduler in `update`). n > 1: the request is prefilled once; when its
prompt's last chunk samples, n tokens are drawn (sequence i with its own generator, seeded
seed + i) and children f"{rid}#{i}" are forked sharing the prompt's blocks.
"""

from __future__ import annotations

import random
import time
from typing import Any, Iterable

import numpy as np
import torch

from pagellm.config import EngineArgs, EngineConfig
from pagellm.engine.kv_cache import KVCacheSpec, allocate_kv_caches, determine_num_blocks
from pagellm.engine.model_runner import ModelRunner
from pagellm.engine.output_processor import (
    FINISH_ABORT,
    FINISH_LENGTH,
    OutputProcessor,
    RequestState,
    SequenceState,
)
from pagellm.logger import init_logger
from pagellm.outputs import RequestOutput
from pagellm.sampling import Sampler, SamplingRow, build_sampling_metadata, compute_prompt_logprobs
from pagellm.sampling_params import SamplingParams

logger = init_logger(__name__)


def _status(name: str):
    from pagellm import _C  # noqa: PLC0415

    return getattr(_C.RequestStatus, name)


def _eos_ids(files, tokenizer) -> list[int]:
    gen = getattr(files, "generation_config", None) or {}
    eos = gen.get("eos_token_id") if isinstance(gen, dict) else getattr(gen, "eos_token_id", None)
    if eos is None:
        eos = getattr(getattr(files, "hf_config", None), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


class LLMEngine:
    def __init__(self, config: EngineConfig, *, model_files=None, log_stats: bool = True) -> None:
        from pagellm import _C  # noqa: PLC0415
        from pagellm.attention import select_attention_backend  # noqa: PLC0415
        from pagellm.model_loader import build_model, open_model  # noqa: PLC0415

        self.config = config
        mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
        self.device = torch.device(mc.device)
        files = model_files if model_files is not None else open_model(mc.model)
        self.model_files = files
        self.tokenizer = files.tokenizer
        if mc.tokenizer is not None:
            from transformers import AutoTokenizer  # noqa: PLC0415

            self.tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer)
        self.generation_config: dict = dict(getattr(files, "generation_config", None) or {})
        self.eos_token_ids = _eos_ids(files, self.tokenizer)
        self.vocab_size = int(files.hf_config.vocab_size)
        self.max_model_len = sc.max_model_len

        self.model = build_model(files, mc.torch_dtype, self.device)
        self.model.eval()
        spec = KVCacheSpec(
            num_layers=self.model.num_layers, num_kv_heads=self.model.num_kv_heads, head_dim=self.model.head_dim,
            block_size=cc.block_size, dtype=mc.torch_dtype,
        )
        self.num_blocks = determine_num_blocks(
            spec, self.device, sc.max_model_len, sc.max_num_seqs, cc.kv_cache_memory_gb, cc.kv_cache_fraction,
            cc.num_kv_blocks,
        )
        self.kv_caches = allocate_kv_caches(spec, self.num_blocks, self.device)
        self.attn_backend = select_attention_backend(mc.attention_backend, self.device)
        self.scheduler = _C.Scheduler(**sc.cpp_kwargs(), **cc.cpp_kwargs(self.num_blocks))
        self.runner = ModelRunner(self.model, self.attn_backend, self.kv_caches, self.device)
        self.sampler = Sampler(torch.Generator(device="cpu").manual_seed(mc.seed))
        self.output_processor = OutputProcessor(self.tokenizer, sc.max_model_len)
        self.log_stats = log_stats
        # seq id -> torch.Generator for seeded sequences
        self._generators: dict[str, torch.Generator] = {}
        self._rng = random.Random(mc.seed)
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs | None = None, **kwargs: Any) -> "LLMEngine":
        """From EngineArgs (or the same keyword arguments)."""
        from pagellm.model_loader import open_model  # noqa: PLC0415

        args = engine_args if engine_args is not None else EngineArgs.from_kwargs(**kwargs)
        files = open_model(args.model)
        hf = files.hf_config
        model_max = getattr(hf, "max_position_embeddings", None)
        config = args.create_engine_config(model_max)
        return cls(config, model_files=files)

    def get_tokenizer(self):
        return self.tokenizer

    # ------------------------------------------------------------------ requests
    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass {'prompt_token_ids': [...]}")
            return prompt, list(self.tokenizer(prompt)["input_ids"]) if prompt else []
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                return prompt.get("prompt"), [int(t) for t in ids]
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt):
            return None, [int(t) for t in prompt]
        raise TypeError(f"prompt must be a str or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Queue a request. Raises ValueError (the engine stays usable) for an empty prompt, token
        ids outside the vocabulary, prompt + max_tokens > max_model_len, invalid sampling
        parameters, or a duplicate request id."""
        request_id = str(request_id)
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if "#" in request_id:
            raise ValueError(f"request_id {request_id!r} must not contain '#' (reserved for n > 1 children)")
        params = SamplingParams() if params is None else params.clone()
        params._verify()  # parameters may have been mutated after construction
        text, ids = self._tokenize(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        bad = [t for t in ids if t < 0 or t >= self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} out of vocabulary (valid range [0, {self.vocab_size}))")
        if params.logit_bias and any(t >= self.vocab_size for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be < vocab size {self.vocab_size}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; it must be shorter than max_model_len={self.max_model_len}")
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(ids)
        elif len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {len(ids) + params.max_tokens} "
                f"exceeds max_model_len={self.max_model_len}; lower max_tokens to <= {self.max_model_len - len(ids)}"
            )
        params.update_from_generation_config(self.eos_token_ids)
        arrival = time.time() if arrival_time is None else float(arrival_time)
        # prompt logprobs need every prompt position computed: keep such requests off the prefix
        # cache with a private hash salt
        extra_key = self._rng.getrandbits(63) + 1 if params.prompt_logprobs is not None else 0
        self.scheduler.add_request(request_id, ids, arrival, priority, extra_key)  # ValueError on invalid
        st = self.output_processor.add_request(request_id, text, ids, params, arrival)
        st.first_step_seen = False  # type: ignore[attr-defined]
        if params.seed is not None:
            self._generators[request_id] = torch.Generator(device="cpu").manual_seed(params.seed)
        self.num_prompt_tokens_total += len(ids)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            res = self.output_processor.abort(str(rid))
            if res is None:
                continue
            st, live = res
            for sid in live:
                self.scheduler.abort(sid)
            self._forget(st)

    def _forget(self, st: RequestState) -> None:
        self.output_processor.remove(st)
        for s in st.seqs:
            self._generators.pop(s.seq_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    def reset_prefix_cache(self) -> bool:
        return bool(self.scheduler.reset_prefix_cache())

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        request_ids = list(out.request_ids)
        if not request_ids:
            return []
        now = time.time()
        op = self.output_processor
        num_computed = np.asarray(out.num_computed_tokens)
        num_sched = np.asarray(out.num_scheduled_tokens)
        do_sample = np.asarray(out.do_sample).astype(bool)

        # rows of this step whose request wants prompt logprobs for positions still missing
        pl_rows: list[int] = []
        for r, sid in enumerate(request_ids):
            st, seq = op.seq(sid)
            if st.metrics.first_scheduled_time is None:
                st.metrics.first_scheduled_time = now
                st.num_cached_tokens = int(num_computed[r])
            if st.prompt_logprobs is not None and len(st.prompt_logprobs) < len(st.prompt_token_ids) and seq.index == 0:
                pl_rows.append(r)

        result = self.runner.execute(out, pl_rows)

        # prompt logprobs: position p predicts prompt token p + 1
        for r in pl_rows:
            st, _ = op.seq(request_ids[r])
            start = int(num_computed[r])
            n = int(num_sched[r])
            P = len(st.prompt_token_ids)
            first = max(start, len(st.prompt_logprobs) - 1)  # skip positions already recorded
            last = min(start + n, P - 1)  # exclusive
            if last <= first:
                continue
            rows = result.prompt_logits[r][first - start : last - start]
            targets = torch.tensor(st.prompt_token_ids[first + 1 : last + 1], dtype=torch.int64)
            lt = compute_prompt_logprobs(rows, targets, st.params.prompt_logprobs)
            ids_l, lps_l, ranks_l = lt.token_ids.tolist(), lt.logprobs.tolist(), lt.ranks.tolist()
            for j in range(len(ids_l)):
                st.prompt_logprobs.append(st.make_logprobs_dict(ids_l[j], lps_l[j], ranks_l[j], st.params.prompt_logprobs))

        # sampling rows (a finished prefill of an n > 1 request expands into n rows)
        sampling_row_ids = [r for r in range(len(request_ids)) if do_sample[r]]
        rows: list[SamplingRow] = []
        logit_rows: list[int] = []
        targets: list[tuple[RequestState, SequenceState | int]] = []  # int: child index to create
        for k, r in enumerate(sampling_row_ids):
            st, seq = op.seq(request_ids[r])
            expand = seq.index == 0 and st.params.n > 1 and len(st.seqs) == 1
            idxs = range(st.params.n) if expand else [seq.index]
            for i in idxs:
                sid = seq.seq_id if i == 0 or not expand else f"{st.request_id}#{i}"
                gen = self._generators.get(sid)
                if gen is None and st.params.seed is not None:
                    gen = torch.Generator(device="cpu").manual_seed(st.params.seed + i)
                    self._generators[sid] = gen
                out_ids = seq.output_token_ids if not expand or i == 0 else []
                rows.append(SamplingRow(st.params, st.prompt_token_ids, out_ids, gen))
                logit_rows.append(k)
                targets.append((st, seq if (not expand or i == 0) else i))

        tokens_list: list[int] = []
        lp_lists = None
        if rows:
            logits = result.logits[torch.tensor(logit_rows)] if len(logit_rows) != len(sampling_row_ids) else result.logits
            md = build_sampling_metadata(rows, self.vocab_size, device=logits.device)
            sout = self.sampler(logits, md)
            tokens_list = sout.sampled_token_ids.tolist()
            if sout.logprobs is not None:
                lt = sout.logprobs
                lp_lists = (lt.token_ids.tolist(), lt.logprobs.tolist(), lt.ranks.tolist())

        # feed tokens to the output states; collect scheduler update arrays
        now = time.time()  # tokens exist from here on (TTFT / TPOT)
        num_new = np.zeros(len(request_ids), dtype=np.int32)
        row_token: dict[str, int] = {}
        child_tokens: list[tuple[str, int]] = []
        finished: list[tuple[str, Any]] = []
        changed: dict[str, RequestState] = {}
        forks: list[tuple[str, str]] = []
        for j, (st, tgt) in enumerate(targets):
            tok = int(tokens_list[j])
            lp_row = (lp_lists[0][j], lp_lists[1][j], lp_lists[2][j]) if lp_lists is not None else None
            if isinstance(tgt, int):  # new child
                if len(st.seqs) == 1:
                    op.add_children(st)
                seq = st.seqs[tgt]
                forks.append((st.request_id, seq.seq_id))
                child_tokens.append((seq.seq_id, tok))
            else:
                seq = tgt
                row_token[seq.seq_id] = tok
            if st.metrics.first_token_time is None:
                st.metrics.first_token_time = now
            st.metrics.last_token_time = now
            if st.append_token(seq, tok, lp_row):
                finished.append((seq.seq_id, _status("FINISHED_LENGTH" if seq.finish_reason == FINISH_LENGTH else "FINISHED_STOPPED")))
            changed[st.request_id] = st
            self.num_generation_tokens_total += 1

        new_ids: list[int] = []
        for r, sid in enumerate(request_ids):
            if sid in row_token:
                num_new[r] = 1
                new_ids.append(row_token[sid])
        for parent, child in forks:
            self.scheduler.fork(parent, child)
        if child_tokens:
            num_new = np.concatenate([num_new, np.ones(len(child_tokens), dtype=np.int32)])
            new_ids.extend(t for _, t in child_tokens)
        self.scheduler.update(out, num_new, np.asarray(new_ids, dtype=np.int64), finished)

        outputs = []
        for st in changed.values():
            outputs.append(st.make_output())
            if st.finished:
                self._forget(st)
        return outputs

    # ------------------------------------------------------------------ stats
    @property
    def num_free_blocks(self) -> int:
        bm = self.scheduler
        for name in ("num_free_blocks", "get_num_free_blocks"):
            v = getattr(bm, name, None)
            if v is not None:
                return int(v() if callable(v) else v)
        raise AttributeError("scheduler exposes no num_free_blocks")
