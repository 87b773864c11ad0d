"""LLM: offline batched generation on top of LLMEngine (vLLM's `LLM` API)."""

from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

from pagellm.config import EngineArgs
from pagellm.engine.llm_engine import LLMEngine
from pagellm.inputs import InputProcessor, PromptType, chat_prompt
from pagellm.lora.request import LoRARequest, lora_requests_per_prompt
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import RequestOutputKind, SamplingParams


def _as_prompt_list(prompts) -> list[PromptType]:
    """One prompt or a batch of them, as a batch (a flat list of ints is one token-id prompt)."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]
    return prompts


class LLM:
    """An engine plus a tokenizer for offline inference.

        llm = LLM()                                    # default model: SmolLM2-135M-Instruct
        outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
        outs = llm.chat([{"role": "user", "content": "Hi"}])
        llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4})  # same outputs, fewer steps
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

    @property
    def input_processor(self) -> InputProcessor:
        """The engine's InputProcessor: what every prompt passed to generate / chat goes through."""
        return self.llm_engine.input_processor

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Release the engine's workers (tensor_parallel_size > 1: stop and reap the worker processes)."""
        self.llm_engine.shutdown()

    # ------------------------------------------------------------------ weights and memory
    def update_weights(self, named_tensors, *, check_finite: bool = False, reset_prefix_cache: bool = True) -> dict:
        """Replace weights in place from an iterable of (hf_name, tensor), the checkpoint's names, each through
        its layer's weight_loader (merged / quantize-on-load layouts handled). Every name, shape and dtype (and
        with `check_finite` NaN/Inf) is checked before anything changes: WeightUpdateError (a ValueError) leaves
        the old weights intact. The prefix cache is reset by default (its KV came from the old weights).
        Returns {"num_tensors", "prefix_cache_reset"}."""
        return self.llm_engine.update_weights(named_tensors, check_finite=check_finite,
                                              reset_prefix_cache=reset_prefix_cache)

    def update_weights_from_disk(self, path, *, check_finite: bool = False, reset_prefix_cache: bool = True) -> dict:
        """update_weights with every tensor of a .safetensors file or an HF directory's safetensors files."""
        return self.llm_engine.update_weights_from_disk(path, check_finite=check_finite,
                                                        reset_prefix_cache=reset_prefix_cache)

    def update_weights_from_distributed(self, group, names, dtypes, shapes, *, src: int = 0,
                                        check_finite: bool = False, reset_prefix_cache: bool = True) -> dict:
        """Receive len(names) tensors by torch.distributed.broadcast from rank `src` of `group` (the trainer
        broadcasts them in this order; gloo on CPU, NCCL on GPU), then update_weights with them."""
        return self.llm_engine.update_weights_from_distributed(group, names, dtypes, shapes, src=src,
                                                               check_finite=check_finite,
                                                               reset_prefix_cache=reset_prefix_cache)

    def sleep(self, level: int = 1) -> dict:
        """Free the KV cache (level 2: the weights too, saved to a temporary file on CPU, to pinned host memory
        on a GPU). No request may be unfinished. generate() raises EngineSleepingError until wake_up().
        Returns {"level", "freed_bytes"}: the measured drop in RSS (CPU) or reserved GPU memory."""
        return self.llm_engine.sleep(level)

    def wake_up(self) -> None:
        """Restore what sleep freed (a zeroed KV cache, the saved weights); outputs are as before sleeping."""
        self.llm_engine.wake_up()

    @property
    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping

    # ------------------------------------------------------------------ LoRA adapters
    def load_lora(self, name: str, path: str, lora_int_id: int | None = None) -> dict:
        """Load a PEFT adapter (adapter_config.json + adapter_model.safetensors) as `name`, or replace the
        adapter of that name in place. Checked in full first (rank <= max_lora_rank, target modules, shapes):
        on ValueError the loaded adapters and the weights are as before. Returns {"rank", "scale", "path"}."""
        return self.llm_engine.add_lora(name, path, lora_int_id)

    def remove_lora(self, name: str) -> None:
        self.llm_engine.remove_lora(name)

    def list_loras(self) -> list[str]:
        return self.llm_engine.list_loras()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams from the model's generation_config (temperature, top_k, top_p, ...)."""
        gen = self.llm_engine.generation_config
        keys = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
        return SamplingParams(**{k: gen[k] for k in keys if gen.get(k) is not None})

    # ------------------------------------------------------------------ generate
    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        """Run a Worker method (by name) or `fn(worker, *args, **kwargs)` on every worker (vLLM's name)."""
        return self.llm_engine.collective_rpc(method, args, kwargs)

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a list; returns RequestOutputs in input order.

        A prompt is a str, a list of token ids, {"prompt": str} or {"prompt_token_ids": [...]}
        (pagellm.inputs); a list of those is a batch. Every prompt is checked (TypeError /
        ValueError) before any is queued. A request whose engine step failed comes back finished with
        RequestOutput.error set (finish_reason "error"); the rest of the batch is unaffected. An
        interrupt (Ctrl-C) aborts this call's requests and leaves the LLM usable. `lora_request`: one
        LoRARequest for every prompt or a list with one (or None) per prompt (needs enable_lora=True).
        """
        prompts = _as_prompt_list(prompts)
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
        lora_requests = lora_requests_per_prompt(lora_request, len(prompts))
        for lr in {lr for lr in lora_requests if lr is not None}:
            engine._resolve_lora(lr)  # an unknown adapter refuses the whole batch before anything is queued
        # tokenized and checked once, all of them before any is queued: a bad batch queues nothing
        processed = [self.input_processor.process(p, sp) for p, sp in zip(prompts, params_list)]
        for req in processed:  # the processor's own clones: _run_engine reads only the finished outputs
            req.params.output_kind = RequestOutputKind.FINAL_ONLY
        ids = []
        try:
            for i, req in enumerate(processed):
                rid = str(next(self._counter))
                engine.add_request(rid, req.as_prompt(), req.params, priority=0 if priority is None else priority[i],
                                   lora_request=lora_requests[i])
                ids.append(rid)
        except BaseException:
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
             chat_template_kwargs: dict[str, Any] | None = None, continue_final_message: bool = False,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate replies for one conversation (a list of {"role", "content"} dicts) or a list of them,
        rendered by pagellm.inputs.apply_chat_template (as the server's chat route does)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.get_tokenizer()
        prompts = [
            chat_prompt(tok, c, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                        chat_template=chat_template, chat_template_kwargs=chat_template_kwargs)
            for c in convs
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def apply_chat_template(self, conversation, add_generation_prompt: bool = True, chat_template: str | None = None,
                            chat_template_kwargs: dict[str, Any] | None = None,
                            continue_final_message: bool = False) -> list[int]:
        """The token ids `chat` would send for this conversation."""
        prompt = chat_prompt(self.get_tokenizer(), conversation, add_generation_prompt=add_generation_prompt,
                             continue_final_message=continue_final_message, chat_template=chat_template,
                             chat_template_kwargs=chat_template_kwargs)
        return self.input_processor.tokenize(prompt)[1]
