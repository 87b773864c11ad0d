"""POST /v1/completions: prompts as a string, strings, token ids or lists of token ids; n; echo
with prompt logprobs (`logprobs` + `echo` + `max_tokens=0` scores a prompt, as eval harnesses do);
streamed (SSE, ending with `data: [DONE]`) or not."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import AsyncIterator

from fastapi import Request

from pagellm.entrypoints.openai.prompt_truncation import truncate_prompt
from pagellm.entrypoints.openai.protocol import CompletionRequest, random_id
from pagellm.entrypoints.openai.serving_base import (SSE_DONE, OpenAIError, ServingBase, error_body, finite_logprob,
                                                     merge_async_iterators, run_until_disconnect, sse)
from pagellm.inputs import ProcessedRequest


def _top_dict(serving, lps: dict | None, k: int, chosen: int | None = None) -> dict[str, float] | None:
    if lps is None:
        return None
    items = sorted(lps.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30,
                                                -kv[1].logprob))
    out: dict[str, float] = {}
    for tid, lp in items[:k]:
        out[serving.token_text(tid, lp)] = finite_logprob(lp.logprob)
    if chosen is not None and chosen in lps:  # the actual token is always there
        lp = lps[chosen]
        out.setdefault(serving.token_text(chosen, lp), finite_logprob(lp.logprob))
    return out


class _LogprobBuilder:
    """Accumulates the OpenAI completions `logprobs` object for one choice, token by token."""

    def __init__(self, serving, k: int, text_offset: int = 0) -> None:
        self.s = serving
        self.k = k
        self.offset = text_offset

    def build(self, token_ids, lps_list, initial: bool = False) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for i, tid in enumerate(token_ids):
            lps = lps_list[i] if lps_list is not None and i < len(lps_list) else None
            lp = lps.get(tid) if lps else None
            text = self.s.token_text(tid, lp)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            if lps is None:
                token_lps.append(None)
                tops.append(None)
            else:
                token_lps.append(finite_logprob(lp.logprob) if lp is not None else None)
                tops.append(_top_dict(self.s, lps, self.k, tid))
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _merge_lp(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return {key: a[key] + b[key] for key in a}


class OpenAIServingCompletion(ServingBase):
    async def create_completion(self, req: CompletionRequest, raw_request: Request | None = None):
        self.check_model(req.model)
        arrival = time.time()
        request_id = random_id("cmpl")
        sp = self.sampling_params(req)
        processed = [await self._process(req, p, sp) for p in req.prompts()]
        gens, ids = await self.admit(request_id, processed, req.priority, arrival, self.lora_request(req.model))
        trackers = [self.metrics.tracker(arrival) if self.metrics else None for _ in gens]
        if req.stream:
            return self._stream(req, request_id, processed, gens, trackers, ids)
        return await run_until_disconnect(self._full(req, request_id, processed, gens, trackers, ids), raw_request)

    async def _process(self, req: CompletionRequest, prompt: str | list[int], sp) -> ProcessedRequest:
        """One prompt through the input processor; a token-id prompt echoed back gets its decoded text."""
        if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
            raise OpenAIError("prompt must be a string, a list of strings, or token ids", param="prompt")
        prompt = await truncate_prompt(self, prompt, sp, req.truncate_prompt_tokens)
        processed = await self.process_prompt(prompt, sp)
        if processed.prompt is None and req.echo:
            processed = replace(processed, prompt=self.tokenizer.decode(processed.prompt_token_ids))
        return processed

    # ------------------------------------------------------------------ non-streaming
    async def _full(self, req, request_id, processed, gens, trackers, ids) -> dict:
        finals = [None] * len(gens)
        try:
            async for i, out in merge_async_iterators(*gens):
                if trackers[i]:
                    trackers[i].on_output(out)
                finals[i] = out
        finally:
            await self.llm.abort(ids)  # no-op for finished requests
        echo_only = req.echo and req.max_tokens == 0
        choices = []
        prompt_tokens = completion_tokens = 0
        for i, out in enumerate(finals):
            if out is None:
                raise OpenAIError("request was aborted", 500, "InternalServerError")
            if trackers[i]:
                trackers[i].finish(out, len(processed[i].prompt_token_ids),
                                   "length" if echo_only else None)
            prompt_ids = processed[i].prompt_token_ids
            prompt_tokens += len(prompt_ids)
            for c in out.outputs:
                text = ""
                lp_obj = None
                builder = _LogprobBuilder(self, req.logprobs or 0)
                if req.echo:
                    text = processed[i].prompt or ""
                    if req.logprobs is not None:
                        lp_obj = builder.build(prompt_ids, out.prompt_logprobs)
                if not echo_only:
                    text += c.text
                    completion_tokens += len(c.token_ids)
                    if req.logprobs is not None:
                        lp_obj = _merge_lp(lp_obj, builder.build(list(c.token_ids), c.logprobs))
                choices.append({
                    "index": i * req.n + c.index, "text": text, "logprobs": lp_obj,
                    "finish_reason": "length" if echo_only else c.finish_reason,
                    "stop_reason": None if echo_only else c.stop_reason,
                })
        choices.sort(key=lambda ch: ch["index"])
        return {
            "id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": self.response_model(req.model),
            "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        }

    # ------------------------------------------------------------------ streaming
    async def _stream(self, req, request_id, processed, gens, trackers, ids) -> AsyncIterator[str]:
        created = int(time.time())
        model = self.response_model(req.model)
        n = req.n
        echo_only = req.echo and req.max_tokens == 0
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        sent_text: dict[int, int] = {}
        sent_toks: dict[int, int] = {}
        builders: dict[int, _LogprobBuilder] = {}
        finished_choices: set[int] = set()
        prompt_tokens = sum(len(p.prompt_token_ids) for p in processed)
        completion_tokens = 0
        completion_by_prompt = [0] * len(gens)

        def chunk(idx, text, logprobs, finish_reason, stop_reason=None):
            return sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                        "choices": [{"index": idx, "text": text, "logprobs": logprobs,
                                     "finish_reason": finish_reason, "stop_reason": stop_reason}]})

        try:
            async for i, out in merge_async_iterators(*gens):
                if trackers[i]:
                    trackers[i].on_output(out)
                parts = []
                for c in out.outputs:
                    idx = i * n + c.index
                    if idx in finished_choices:
                        continue
                    if idx not in builders:  # first chunk of this choice: the echoed prompt
                        builders[idx] = _LogprobBuilder(self, req.logprobs or 0)
                        sent_text[idx] = 0
                        sent_toks[idx] = 0
                        if req.echo:
                            lp = (builders[idx].build(processed[i].prompt_token_ids, out.prompt_logprobs)
                                  if req.logprobs is not None else None)
                            if echo_only:
                                finished_choices.add(idx)
                                parts.append(chunk(idx, processed[i].prompt or "", lp, "length"))
                                continue
                            parts.append(chunk(idx, processed[i].prompt or "", lp, None))
                    if echo_only:
                        continue
                    delta = c.text[sent_text[idx]:]
                    new_ids = c.token_ids[sent_toks[idx]:]
                    if not delta and not new_ids and c.finish_reason is None:
                        continue
                    lp = None
                    if req.logprobs is not None and new_ids:
                        lp = builders[idx].build(new_ids, (c.logprobs or [])[sent_toks[idx]:])
                    sent_text[idx] = len(c.text)
                    sent_toks[idx] = len(c.token_ids)
                    if c.finish_reason is not None:
                        finished_choices.add(idx)
                    parts.append(chunk(idx, delta, lp, c.finish_reason, c.stop_reason))
                if out.finished:
                    completion_by_prompt[i] = 0 if echo_only else sum(len(c.token_ids) for c in out.outputs)
                    if trackers[i]:
                        trackers[i].finish(out, len(processed[i].prompt_token_ids),
                                           "length" if echo_only else None)
                if parts:
                    yield "".join(parts)
            completion_tokens = sum(completion_by_prompt)
            if include_usage:
                yield sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                           "choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                                    "completion_tokens": completion_tokens,
                                                    "total_tokens": prompt_tokens + completion_tokens}})
        except OpenAIError as e:
            yield sse(e.body())
        except (ValueError, RuntimeError) as e:
            yield sse(error_body(str(e), "InternalServerError", code=500))
        finally:
            await self.llm.abort(ids)  # client gone (or error): free the blocks; no-op when finished
        yield SSE_DONE
