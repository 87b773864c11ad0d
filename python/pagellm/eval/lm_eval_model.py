"""The lm-evaluation-harness model type "pagellm": lm-eval's request types on the offline `LLM`.

    lm_eval --model pagellm --model_args pretrained=DIR,dtype=float32,max_length=2048 --tasks ...
    (through `pagellm-eval`, see pagellm/eval/__init__.py)

Scores the way lm-eval's `hf` backend does, so the two agree on the same weights:
- loglikelihood: context + continuation encoded whole and split (TemplateLM._encode_pair), an empty
  context replaced by `prefix_token_id` (BOS, else EOS); the sequence left-truncated to max_length + 1
  tokens; the continuation's summed logprob and whether every token was the argmax, read from the
  engine's prompt logprobs (raw log_softmax in float32: `prompt_logprobs=0` gives the actual token's
  logprob and rank).
- loglikelihood_rolling: lm_eval.utils.get_rolling_token_windows over the document (max_length tokens
  per window, context_len 1), each window scored as one loglikelihood request, summed per document.
- generate_until: contexts left-truncated to max_length - max_gen_toks tokens, `until` stop strings plus
  the EOS text, greedy unless the task's gen_kwargs sample, the text cut at the first stop string.
"""

from __future__ import annotations

import logging
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    _add_special_kwargs,
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from pagellm.llm import LLM
from pagellm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 64  # requests handed to LLM.generate at once ("auto" too): the engine batches them
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default
# gen_kwargs lm-eval tasks use, by SamplingParams name; anything else is refused (ValueError)
_GEN_KWARG_NAMES = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "seed": "seed", "repetition_penalty": "repetition_penalty",
                    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
_IGNORED_GEN_KWARGS = ("do_sample",)  # folded into temperature by normalize_gen_kwargs

Window = tuple[Any, list[int], list[int]]  # (cache key or None, context tokens, continuation tokens)


def _batch_size(value) -> int:
    if value is None or (isinstance(value, str) and value.startswith("auto")):
        return DEFAULT_BATCH_SIZE
    n = int(value)
    if n < 1:
        raise ValueError(f"batch_size must be an integer >= 1 or 'auto', got {value!r}")
    return n


def _device(value: str | None) -> str | None:
    """lm-eval's CLI defaults to device=cuda:0; without CUDA the engine runs on the CPU."""
    if value is None:
        return None
    value = str(value)
    if value.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            logger.warning("device=%s asked for but CUDA is not available: running on the CPU", value)
            return "cpu"
        return "cuda"
    if value != "cpu":
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {value!r}")
    return value


@register_model("pagellm")
class PagellmLM(TemplateLM):
    """lm-eval model type over `pagellm.LLM`.

    pretrained: HF directory / hub id / .gguf (LLM's `model`); dtype: LLM's dtype ("auto", "float32",
    "bfloat16", ...); max_length: the longest scored sequence (default: the engine's max_model_len - 2,
    room for a prompt of max_length + 1 tokens plus the one generated token a request needs);
    batch_size: requests per LLM.generate call; max_gen_toks: generate_until's default budget;
    add_bos_token / prefix_token_id: as in lm-eval's hf backend; any other keyword goes to LLM(...).
    """

    def __init__(self, pretrained: str, dtype: str = "auto", max_length: int | None = None,
                 batch_size: int | str | None = 1, max_batch_size: int | None = None, device: str | None = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, add_bos_token: bool | None = None,
                 prefix_token_id: int | None = None, seed: int = 0, **llm_kwargs: Any) -> None:
        super().__init__()
        if max_length is not None and int(max_length) < 2:
            raise ValueError(f"max_length must be an integer >= 2, got {max_length!r}")
        if int(max_gen_toks) < 1:
            raise ValueError(f"max_gen_toks must be an integer >= 1, got {max_gen_toks!r}")
        self.batch_size_per_call = _batch_size(batch_size)
        del max_batch_size  # the engine batches by its own token budget
        device = _device(device)
        if device is not None:
            llm_kwargs["device"] = device
        self.llm = LLM(model=str(pretrained), dtype=dtype, seed=int(seed), **llm_kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.engine_max_len = self.llm.llm_engine.max_model_len
        self._max_length = int(max_length) if max_length is not None else self.engine_max_len - 2
        self._max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self.pretrained = str(pretrained)

    # ------------------------------------------------------------------ what lm-eval reads
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return int(self.custom_prefix_token_id)
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        """As the hf backend: the tokenizer's default special tokens unless told (or the text already
        starts with the BOS text)."""
        special = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        ids = self.tokenizer.encode(string, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    # ------------------------------------------------------------------ scoring
    def _loglikelihood_tokens(self, requests: list[Window], disable_tqdm: bool = False,
                              **kwargs) -> list[tuple[float, bool]]:
        """(summed continuation logprob, all greedy) per (key, context ids, continuation ids)."""
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        results: list[tuple[float, bool]] = []
        for start in range(0, len(requests), self.batch_size_per_call):
            chunk = requests[start : start + self.batch_size_per_call]
            prompts, num_conts = [], []
            for _, context_ids, continuation_ids in chunk:
                if not context_ids or not continuation_ids:
                    raise ValueError("a loglikelihood request needs a non-empty context and continuation")
                # the hf backend's window: max_length + 1 tokens (its input is all but the last);
                # the engine holds at most max_model_len - 1 prompt tokens
                keep = min(self._max_length + 1, self.engine_max_len - 1)
                prompts.append({"prompt_token_ids": (context_ids + continuation_ids)[-keep:]})
                num_conts.append(min(len(continuation_ids), keep - 1))
            outs = self.llm.generate(prompts, params, use_tqdm=False)
            for (key, _, _), out, n in zip(chunk, outs, num_conts):
                if out.error is not None:
                    raise RuntimeError(f"pagellm failed a loglikelihood request: {out.error}")
                ids, lps = out.prompt_token_ids, out.prompt_logprobs
                picked = [lps[i][ids[i]] for i in range(len(ids) - n, len(ids))]
                results.append((sum(p.logprob for p in picked), all(p.rank == 1 for p in picked)))
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, results[-1])
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Summed logprob of each whole document, scored in disjoint windows of max_length tokens."""
        windows: list[Window] = []
        counts = []
        for (text,) in [req.args for req in requests]:
            doc_windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self._max_length, context_len=1)]
            windows.extend((None, ctx, cont) for ctx, cont in doc_windows)
            counts.append(len(doc_windows))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals, pos = [], 0
        for req, n in zip(requests, counts):
            total = sum(s for s, _ in scores[pos : pos + n])
            pos += n
            totals.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or the task's sampling) generation, stopped at `until` / EOS / max_gen_toks."""
        eos_text = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        prompts, params_list, stops = [], [], []
        for context, gen_kwargs in [req.args for req in requests]:
            params, until, max_gen_toks = self._sampling_params(gen_kwargs, eos_text)
            limit = min(self._max_length, self.engine_max_len)
            if max_gen_toks >= limit:
                raise ValueError(f"max_gen_toks ({max_gen_toks}) must be < max_length ({self._max_length}) and "
                                 f"the engine's max_model_len ({self.engine_max_len})")
            room = limit - max_gen_toks  # the hf backend's context budget: max_length - max_gen_toks
            prompts.append({"prompt_token_ids": self.tok_encode(context, left_truncate_len=room)})
            params_list.append(params)
            stops.append(until)
        texts: list[str] = []
        for start in range(0, len(prompts), self.batch_size_per_call):
            end = start + self.batch_size_per_call
            for out in self.llm.generate(prompts[start:end], params_list[start:end], use_tqdm=False):
                if out.error is not None:
                    raise RuntimeError(f"pagellm failed a generate_until request: {out.error}")
                texts.append(out.outputs[0].text)
        results = []
        for req, text, until in zip(requests, texts, stops):
            text = postprocess_generated_text(generation=text, stop=until, think_end_token=None)
            results.append(text)
            self.cache_hook.add_partial("generate_until", req.args, text)
        return results

    def _sampling_params(self, gen_kwargs: dict, eos_text: str) -> tuple[SamplingParams, list[str], int]:
        """lm-eval gen_kwargs -> (SamplingParams, stop strings incl. the EOS text, max_gen_toks)."""
        if not isinstance(gen_kwargs, dict):
            raise TypeError(f"gen_kwargs must be a dict, got {type(gen_kwargs).__name__}")
        kwargs = normalize_gen_kwargs(dict(gen_kwargs), self._max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
        max_gen_toks = int(kwargs.pop("max_gen_toks"))
        for name in _IGNORED_GEN_KWARGS:
            kwargs.pop(name, None)
        unknown = sorted(set(kwargs) - set(_GEN_KWARG_NAMES))
        if unknown:
            raise ValueError(f"unsupported gen_kwargs {unknown}; supported: until, max_gen_toks, do_sample, "
                             f"{sorted(_GEN_KWARG_NAMES)}")
        sp = {_GEN_KWARG_NAMES[k]: v for k, v in kwargs.items()}
        # stop strings the engine checks: the non-empty ones (at most SamplingParams' limit per request)
        stop = [s for s in until if s][:64]
        return SamplingParams(max_tokens=max_gen_toks, stop=stop, **sp), until, max_gen_toks
