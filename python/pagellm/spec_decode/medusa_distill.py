"""Self-distillation data recorded while pagellm answers: the served hidden states, no second forward pass.

`pagellm train-medusa --data distill` (medusa_train_data.py) has the engine answer many prompts (medusa_prompts.py)
in the dtype it serves with, greedy and sampled, batched. `HiddenStateRecorder` is a proposer that drafts nothing:
it only asks the engine for what a Medusa / Hydra proposer reads, the final normed hidden state that gave each
sequence its newest token, and keeps it. So the heads train on the very states the proposer will be handed (the
engine's bf16 kernels, not HF's fp32 forward), and computing them costs nothing beyond the answers themselves.

Per answered prompt `DistillSequence`: token ids (prompt + answer), hidden [L, H] (rows before the prompt's last
token are zero: never trained), and label_ids [L]: the target's greedy choice at each position (the answer's own
tokens for a greedy answer; for a sampled one the argmax of the engine's own LM head over the recorded states;
per-request seeds and logprobs made sampled answers ~6x slower), so sampled answers teach what the
greedy verifier will accept while widening the contexts the heads see.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from pagellm.spec_decode.base import BaseProposer, DraftRequest


class HiddenStateRecorder(BaseProposer):
    """Keeps, per sequence and position t, the final hidden state h_t the engine computed (the one whose logits
    gave token t + 1). Proposes nothing: every step stays a plain decode step."""

    needs_hidden_states = True

    def __init__(self) -> None:
        super().__init__(1)
        self.states: dict[str, dict[int, torch.Tensor]] = {}

    def propose(self, requests: Sequence[DraftRequest]) -> dict:
        return {}

    def observe_hidden_states(self, seq_ids: Sequence[str], num_tokens: Sequence[int], hidden) -> None:
        rows = hidden.detach().to("cpu")  # the model's dtype: its LM head gives back its tokens (greedy_labels)
        for sid, n, row in zip(seq_ids, num_tokens, rows):
            self.states.setdefault(sid, {})[int(n) - 2] = row.clone()  # newest token n - 1 came from position n - 2

    def take(self, seq_id: str) -> dict[int, torch.Tensor]:
        return self.states.pop(seq_id, {})


@dataclass
class DistillSequence:
    token_ids: list[int]  # prompt + answer
    prompt_len: int
    hidden: torch.Tensor  # [L, H] the model's dtype (bf16 when serving bf16); rows < prompt_len - 1 zero
    label_ids: list[int]  # [L] the target's greedy token at each position (prompt positions: the prompt's)


@torch.no_grad()
def greedy_labels(token_ids: list[int], prompt_len: int, hidden: torch.Tensor,
                  compute_logits: Callable[[torch.Tensor], torch.Tensor], chunk: int = 256) -> list[int]:
    """[L] the target's greedy token at each position: the argmax of its own LM head (`compute_logits`, the
    serving model's) over the recorded state before it; the text's token where no state was recorded."""
    labels = list(token_ids)
    first, last = prompt_len - 1, len(token_ids) - 1  # states h_first .. h_{last-1} choose tokens first+1 .. last
    for s in range(first, last, chunk):
        e = min(last, s + chunk)
        rows = hidden[s:e]
        best = compute_logits(rows).argmax(dim=-1).tolist()
        recorded = (rows != 0).any(dim=-1).tolist()
        for j, (tok, ok) in enumerate(zip(best, recorded)):
            if ok:
                labels[s + j + 1] = int(tok)
    return labels


def _hidden_rows(states: dict[int, torch.Tensor], length: int, prompt_len: int, hidden_size: int) -> torch.Tensor:
    dtype = next(iter(states.values())).dtype if states else torch.bfloat16
    out = torch.zeros(length, hidden_size, dtype=dtype)
    for pos, row in states.items():
        if prompt_len - 1 <= pos < length:
            out[pos] = row
    return out


def record_answers(llm, prompts: list[list[int]], answer_len: int, temperature: float = 0.0,
                   say: Callable[[str], None] | None = None, chunk: int = 256) -> list[DistillSequence]:
    """`llm` (a pagellm LLM, any dtype) answers each token-id prompt (to its first EOS, at most answer_len tokens),
    greedy (temperature 0) or sampled (top-p 0.95; labels: greedy_labels), while a HiddenStateRecorder keeps the
    hidden states. Sets and then clears the engine's proposer. Chunks of `chunk` prompts bound the states held.
    A prompt that does not fit max_model_len with answer_len tokens after it is left out (the rest are answered)."""
    from pagellm import SamplingParams  # noqa: PLC0415

    if not isinstance(answer_len, int) or answer_len < 1:
        raise ValueError(f"answer_len must be an integer >= 1, got {answer_len!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    engine = llm.llm_engine
    hidden_size = int(engine.model_files.hf_config.hidden_size)
    fits = [p for p in prompts if len(p) + answer_len <= engine.max_model_len]
    if say and len(fits) < len(prompts):
        say(f"{len(prompts) - len(fits)} prompts skipped: longer than max_model_len={engine.max_model_len} with the answer")
    prompts = fits
    recorder = HiddenStateRecorder()
    engine.set_proposer(recorder, disable_by_batch_size=1 << 30)  # every step: the states of every sequence
    out: list[DistillSequence] = []
    try:
        for start in range(0, len(prompts), chunk):
            part = prompts[start : start + chunk]
            params = SamplingParams(temperature=temperature, top_p=0.95 if temperature > 0 else 1.0,
                                    max_tokens=answer_len)
            results = llm.generate([{"prompt_token_ids": p} for p in part], params, use_tqdm=False)
            for p, res in zip(part, results):
                ids = list(p) + list(res.outputs[0].token_ids)
                hidden = _hidden_rows(recorder.take(res.request_id), len(ids), len(p), hidden_size)
                labels = ids if temperature == 0 else greedy_labels(ids, len(p), hidden, engine.model.compute_logits)
                out.append(DistillSequence(ids, len(p), hidden, labels))
            if say:
                say(f"answered {start + len(part)}/{len(prompts)} prompts (temperature {temperature})")
    finally:
        engine.set_proposer(None)
    return out
