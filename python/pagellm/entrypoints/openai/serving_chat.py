"""POST /v1/chat/completions: the conversation rendered by pagellm.inputs.chat (as LLM.chat renders
it), n, logprobs/top_logprobs, stop, seed, max_tokens/max_completion_tokens, streaming with
stream_options.include_usage."""

from __future__ import annotations

import time
from typing import AsyncIterator

from fastapi import Request

from pagellm.entrypoints.openai.prompt_truncation import truncate_prompt
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, random_id
from pagellm.entrypoints.openai.input_checks import safe_message
from pagellm.entrypoints.openai.serving_base import (MIN_LOGPROB, SSE_DONE, OpenAIError, ServingBase, error_body,
                                                     finite_logprob, run_until_disconnect, sse)
from pagellm.inputs import ProcessedRequest, TextPrompt, chat_prompt


class OpenAIServingChat(ServingBase):
    async def render_prompt(self, req, tokenize_only: bool = False) -> TextPrompt:
        """The request's conversation as a TextPrompt (rendered on the tokenizer thread). tokenize_only: for
        /tokenize, under its larger character cap."""
        messages = []
        for m in req.messages:
            try:
                messages.append({"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})})
            except ValueError as e:
                raise OpenAIError(str(e), param="messages") from e
        self.check_prompt_chars(sum(len(m["content"]) for m in messages), "messages", tokenize_only)
        if req.continue_final_message and req.add_generation_prompt:
            raise OpenAIError("continue_final_message and add_generation_prompt cannot both be true",
                              param="continue_final_message")
        try:
            return await self.llm.run_in_tokenizer_thread(
                lambda: chat_prompt(self.tokenizer, messages, add_generation_prompt=req.add_generation_prompt,
                                    continue_final_message=req.continue_final_message,
                                    chat_template_kwargs=req.chat_template_kwargs))
        except Exception as e:  # template errors (e.g. a role the template rejects) are the client's
            raise OpenAIError(f"chat template failed: {safe_message(str(e), 200)}", param="messages") from e

    async def process_chat(self, req: ChatCompletionRequest) -> ProcessedRequest:
        """The request's rendered, tokenized and validated input: what is sent to the engine."""
        sp = self.sampling_params(req)
        prompt = await truncate_prompt(self, await self.render_prompt(req), sp, req.truncate_prompt_tokens)
        return await self.process_prompt(prompt, sp)

    async def create_chat_completion(self, req: ChatCompletionRequest, raw_request: Request | None = None):
        self.check_model(req.model)
        arrival = time.time()
        request_id = random_id("chatcmpl")
        processed = await self.process_chat(req)
        ids, text = processed.prompt_token_ids, processed.prompt
        (gen,), rids = await self.admit(request_id, [processed], req.priority, arrival, self.lora_request(req.model))
        tracker = self.metrics.tracker(arrival) if self.metrics else None
        if req.stream:
            return self._stream(req, request_id, ids, text, gen, tracker, rids)
        return await run_until_disconnect(self._full(req, request_id, ids, text, gen, tracker, rids), raw_request)

    # ------------------------------------------------------------------ logprobs
    def _logprobs(self, token_ids, lps_list, k: int) -> list[dict]:
        content = []
        for i, tid in enumerate(token_ids):
            lps = lps_list[i] if lps_list is not None and i < len(lps_list) else None
            if not lps:
                continue
            lp = lps.get(tid)
            text = self.token_text(tid, lp)
            tops = sorted(lps.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30,
                                                        -kv[1].logprob))[:k]
            content.append({
                "token": text, "logprob": finite_logprob(lp.logprob) if lp is not None else MIN_LOGPROB,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [{"token": (t := self.token_text(t_id, t_lp)), "logprob": finite_logprob(t_lp.logprob),
                                  "bytes": list(t.encode("utf-8"))} for t_id, t_lp in tops],
            })
        return content

    # ------------------------------------------------------------------ non-streaming
    async def _full(self, req, request_id, prompt_ids, prompt_text, gen, tracker, rids) -> dict:
        final = None
        try:
            async for out in gen:
                if tracker:
                    tracker.on_output(out)
                final = out
        finally:
            await self.llm.abort(rids)  # no-op for finished requests
        if final is None:
            raise OpenAIError("request was aborted", 500, "InternalServerError")
        if tracker:
            tracker.finish(final, len(prompt_ids))
        choices = []
        completion_tokens = 0
        for c in final.outputs:
            completion_tokens += len(c.token_ids)
            content = (prompt_text + c.text) if req.echo else c.text
            choices.append({
                "index": c.index, "message": {"role": "assistant", "content": content},
                "logprobs": ({"content": self._logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)}
                             if req.logprobs else None),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            })
        return {
            "id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": self.response_model(req.model),
            "choices": choices,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                      "total_tokens": len(prompt_ids) + completion_tokens},
        }

    # ------------------------------------------------------------------ streaming
    async def _stream(self, req, request_id, prompt_ids, prompt_text, gen, tracker, rids) -> AsyncIterator[str]:
        created = int(time.time())
        model = self.response_model(req.model)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        sent_text = [0] * req.n
        sent_toks = [0] * req.n
        done = [False] * req.n
        completion_tokens = 0

        def chunk(idx, delta, logprobs=None, finish_reason=None, stop_reason=None):
            return sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [{"index": idx, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": finish_reason, "stop_reason": stop_reason}]})

        try:
            first = "".join(chunk(i, {"role": "assistant", "content": prompt_text if req.echo else ""})
                            for i in range(req.n))
            yield first
            async for out in gen:
                if tracker:
                    tracker.on_output(out)
                parts = []
                for c in out.outputs:
                    i = c.index
                    if done[i]:
                        continue
                    delta = c.text[sent_text[i]:]
                    new_ids = c.token_ids[sent_toks[i]:]
                    if not delta and not new_ids and c.finish_reason is None:
                        continue
                    lp = None
                    if req.logprobs and new_ids:
                        lp = {"content": self._logprobs(new_ids, (c.logprobs or [])[sent_toks[i]:],
                                                        req.top_logprobs or 0)}
                    sent_text[i] = len(c.text)
                    sent_toks[i] = len(c.token_ids)
                    if c.finish_reason is not None:
                        done[i] = True
                    parts.append(chunk(i, {"content": delta} if delta or c.finish_reason is None else {},
                                       lp, c.finish_reason, c.stop_reason))
                if out.finished:
                    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
                    if tracker:
                        tracker.finish(out, len(prompt_ids))
                if parts:
                    yield "".join(parts)
            if include_usage:
                yield sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": [], "usage": {"prompt_tokens": len(prompt_ids),
                                                    "completion_tokens": completion_tokens,
                                                    "total_tokens": len(prompt_ids) + completion_tokens}})
        except OpenAIError as e:
            yield sse(e.body())
        except (ValueError, RuntimeError) as e:
            yield sse(error_body(str(e), "InternalServerError", code=500))
        finally:
            await self.llm.abort(rids)  # client gone (or error): free the blocks; no-op when finished
        yield SSE_DONE
