"""LLM: offline batched generation on top of LLMEngine (vLLM's `LLM` API)."""

from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

from pagellm.config import EngineArgs
from pagellm.engine.llm_engine import LLMEngine
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams


class LLM:
    """An engine plus a tokenizer for offline inference.

        llm = LLM()                                    # default model: SmolLM2-135M-Instruct
        outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
        outs = llm.chat([{"role": "user", "content": "Hi"}])
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        enable_chunked_prefill: bool = True,
        block_size: int = 16,
        kv_cache_memory_gb: float | None = None,
        gpu_memory_utilization: float | None = None,
        kv_cache_fraction: float = 0.9,
        num_kv_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        attention_backend: str | None = None,
        seed: int = 0,
        device: str = "cpu",
        **kwargs: Any,
    ) -> None:
        args = EngineArgs.from_kwargs(
            model=None if model is None else str(model), tokenizer=tokenizer, dtype=dtype, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill, block_size=block_size,
            kv_cache_memory_gb=kv_cache_memory_gb, gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_fraction=kv_cache_fraction, num_kv_blocks=num_kv_blocks,
            enable_prefix_caching=enable_prefix_caching, attention_backend=attention_backend, seed=seed,
            device=device, **kwargs,
        )
        self.llm_engine = LLMEngine.from_engine_args(args)
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams from the model's generation_config (temperature, top_k, top_p, ...)."""
        gen = self.llm_engine.generation_config
        keys = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
        return SamplingParams(**{k: gen[k] for k in keys if gen.get(k) is not None})

    # ------------------------------------------------------------------ generate
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a list; returns RequestOutputs in input order.

        A prompt is a str, {"prompt_token_ids": [...]} or {"prompt": str}.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        engine = self.llm_engine
        ids = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params_list)):
                rid = str(next(self._counter))
                engine.add_request(rid, p, sp, priority=0 if priority is None else priority[i])
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)
            raise
        return self._run_engine(ids, use_tqdm)

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        pbar = None
        if use_tqdm:
            from tqdm.auto import tqdm  # noqa: PLC0415

            pbar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True,
                        postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        start = time.perf_counter()
        in_toks = out_toks = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        if pbar is not None:
                            in_toks += len(out.prompt_token_ids)
                            out_toks += sum(len(o.token_ids) for o in out.outputs)
                            el = max(time.perf_counter() - start, 1e-9)
                            pbar.postfix = f"est. speed input: {in_toks / el:.2f} toks/s, output: {out_toks / el:.2f} toks/s"
                            pbar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in finished])
            raise
        finally:
            if pbar is not None:
                pbar.close()
        return [finished[i] for i in ids]

    # ------------------------------------------------------------------ chat
    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, continue_final_message: bool = False) -> list[RequestOutput]:
        """Generate replies for one conversation (a list of {"role", "content"} dicts) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            {"prompt_token_ids": self.apply_chat_template(c, add_generation_prompt, chat_template,
                                                          chat_template_kwargs, continue_final_message)}
            for c in convs
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, conversation, add_generation_prompt: bool = True, chat_template: str | None = None,
                            chat_template_kwargs: dict[str, Any] | None = None,
                            continue_final_message: bool = False) -> list[int]:
        tok = self.get_tokenizer()
        text = tok.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, chat_template=chat_template, **(chat_template_kwargs or {}),
        )
        # the template already carries BOS etc.
        return list(tok(text, add_special_tokens=False)["input_ids"])
