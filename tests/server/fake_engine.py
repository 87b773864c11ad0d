"""A small, deterministic stand-in for LLMEngine (same interface), for testing the async front
and the server without a model: character-level tokenizer, paged block accounting, max_num_seqs
batching, n, stop strings, logprobs and prompt logprobs. `step_time` sleeps (GIL released) to
emulate a model forward pass."""

from __future__ import annotations

import math
import time

from pagellm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagellm.engine.stats import EngineStats
from pagellm.sampling_params import SamplingParams


class CharTokenizer:
    """id 0 = <eos>, ids 1..95 = printable ASCII (space..~), 96 = newline."""

    eos_token_id = 0
    eos_token = "<eos>"
    vocab_size = 97
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = []
        for ch in text:
            if ch == "\n":
                ids.append(96)
            elif 32 <= ord(ch) < 127:
                ids.append(ord(ch) - 31)
            else:
                ids.append(ord("?") - 31)
        return ids

    def decode(self, ids, skip_special_tokens: bool = True, **kw) -> str:
        out = []
        for t in ids:
            t = int(t)
            if t == 0:
                if not skip_special_tokens:
                    out.append(self.eos_token)
            elif t == 96:
                out.append("\n")
            elif 1 <= t < 96:
                out.append(chr(t + 31))
        return "".join(out)

    def convert_ids_to_tokens(self, ids):
        return [self.decode([i], skip_special_tokens=False) for i in ids]


class _Seq:
    def __init__(self, req, index):
        self.req = req
        self.index = index
        self.token_ids: list[int] = []
        self.logprobs = [] if req.params.logprobs is not None else None
        self.cum_lp = 0.0
        self.text = ""
        self.finish_reason = None
        self.stop_reason = None
        self.blocks = 0


class _Req:
    def __init__(self, rid, ids, params, arrival):
        self.rid = rid
        self.ids = ids
        self.params = params
        self.seqs = [_Seq(self, i) for i in range(params.n)]
        self.metrics = RequestMetrics(arrival_time=arrival)
        self.prompt_logprobs = None


class FakeEngine:
    def __init__(self, max_model_len=256, max_num_seqs=8, num_blocks=512, block_size=16, step_time=0.002,
                 eos_after=None):
        self.tokenizer = CharTokenizer()
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.num_total_blocks = num_blocks
        self.num_free_blocks = num_blocks
        self.block_size = block_size
        self.step_time = step_time
        self.eos_after = eos_after
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.reqs: dict[str, _Req] = {}
        self.prefix_cache_hits = 0
        self.prefix_cache_queries = 0
        self.num_steps = 0

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def vocab_size(self):
        return self.tokenizer.vocab_size

    def get_stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.num_running, num_waiting=self.num_waiting,
            kv_cache_usage=1.0 - self.num_free_blocks / self.num_total_blocks,
            num_free_blocks=self.num_free_blocks, num_total_blocks=self.num_total_blocks,
            prefix_cache_queries=self.prefix_cache_queries, prefix_cache_hits=self.prefix_cache_hits,
            num_steps=self.num_steps, timestamp=time.time(),
        )

    # -- interface
    def add_request(self, request_id, prompt, params: SamplingParams, arrival_time=None, priority=0):
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt["prompt_token_ids"])
        if len(ids) >= self.max_model_len:
            raise ValueError("prompt too long")
        if request_id in self.reqs:
            raise ValueError("duplicate id")
        params = params.clone()
        params.update_from_generation_config([0])
        req = _Req(request_id, ids, params, arrival_time or time.time())
        self.reqs[request_id] = req
        self.waiting.append(req)
        self.prefix_cache_queries += len(ids)

    def abort_request(self, request_id):
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            req = self.reqs.pop(rid, None)
            if req is None:
                continue
            if req in self.waiting:
                self.waiting.remove(req)
            if req in self.running:
                self.running.remove(req)
            self._free(req)

    def _free(self, req):
        for s in req.seqs:
            self.num_free_blocks += s.blocks
            s.blocks = 0

    def has_unfinished_requests(self):
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self):
        return len(self.waiting) + len(self.running)

    @property
    def num_running(self):
        return len(self.running)

    @property
    def num_waiting(self):
        return len(self.waiting)

    def _logprob_dict(self, chosen, k, pos):
        d = {chosen: Logprob(-0.5 - (pos % 3) * 0.1, 1 + (pos % 2), self.tokenizer.decode([chosen]))}
        for r in range(k):
            t = 1 + (pos * 7 + r * 13) % 95
            if t not in d:
                d[t] = Logprob(-1.0 - r, r + 1, self.tokenizer.decode([t]))
        return d

    def step(self):
        self.num_steps += 1
        while self.waiting and sum(len(r.seqs) for r in self.running) + self.waiting[0].params.n <= self.max_num_seqs:
            req = self.waiting.pop(0)
            req.metrics.first_scheduled_time = time.time()
            if req.params.prompt_logprobs is not None:
                k = req.params.prompt_logprobs
                req.prompt_logprobs = [None] + [self._logprob_dict(t, k, i) for i, t in enumerate(req.ids[1:])]
            for s in req.seqs:
                need = math.ceil(len(req.ids) / self.block_size)
                s.blocks = need
                self.num_free_blocks -= need
            self.running.append(req)
        if self.step_time:
            time.sleep(self.step_time)
        outs = []
        now = time.time()
        for req in list(self.running):
            p = req.params
            for s in req.seqs:
                if s.finish_reason:
                    continue
                n = len(s.token_ids)
                if self.eos_after is not None and n >= self.eos_after and not p.ignore_eos and n >= p.min_tokens:
                    tok = 0
                else:
                    base = (p.seed or 0) * 31 + s.index * 5 + len(req.ids)
                    tok = 1 + (base + n * 3) % 26 + 65 - 32  # letters 'A'..'Z' cycling
                s.token_ids.append(tok)
                if s.logprobs is not None:
                    s.logprobs.append(self._logprob_dict(tok, p.logprobs, n))
                s.cum_lp += -0.5
                total = len(req.ids) + len(s.token_ids)
                need = math.ceil(total / self.block_size)
                if need > s.blocks:
                    self.num_free_blocks -= need - s.blocks
                    s.blocks = need
                if tok in p.all_stop_token_ids:
                    s.finish_reason, s.stop_reason = "stop", (None if tok == 0 else tok)
                else:
                    s.text += self.tokenizer.decode([tok])
                    for st in p.stop:
                        i = s.text.find(st)
                        if i >= 0:
                            s.text = s.text[: i + len(st)] if p.include_stop_str_in_output else s.text[:i]
                            s.finish_reason, s.stop_reason = "stop", st
                            break
                if s.finish_reason is None and (p.max_tokens is not None and len(s.token_ids) >= p.max_tokens
                                                or total >= self.max_model_len):
                    s.finish_reason = "length"
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.last_token_time = now
            req.metrics.num_generation_tokens = max(len(s.token_ids) for s in req.seqs)
            finished = all(s.finish_reason for s in req.seqs)
            if finished:
                req.metrics.finished_time = now
                self.running.remove(req)
                self.reqs.pop(req.rid, None)
                self._free(req)
            outs.append(RequestOutput(
                request_id=req.rid, prompt=None, prompt_token_ids=list(req.ids),
                prompt_logprobs=req.prompt_logprobs,
                outputs=[CompletionOutput(s.index, s.text, list(s.token_ids), s.cum_lp,
                                          list(s.logprobs) if s.logprobs is not None else None,
                                          s.finish_reason, s.stop_reason) for s in req.seqs],
                finished=finished, metrics=req.metrics))
        return outs
