"""Shared by the Medusa and Hydra train/serve agreement tests: the tiny fp32 Llama as an HF model, and draft heads
trained the trainer's way on its own greedy continuations (over a draft vocabulary), with held-out prompts."""

from __future__ import annotations

import torch

from test_draft_tokens import _greedy, _tie_free_prompts

from pagellm.spec_decode.medusa_train import MedusaTrainConfig, frequent_tokens, head_targets, train_heads
from pagellm.spec_decode.medusa_train_data import final_hidden_states, greedy_continuations

HIDDEN, NUM_HEADS, NEW_TOKENS = 64, 3, 40


def load_base(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval().requires_grad_(False)


def train_tiny_heads(heads, base, tiny_llama_dir, vocab_size: int, out_dir) -> tuple[str, list[list[int]]]:
    """`heads` (NUM_HEADS heads over HIDDEN, any kind) trained on the tiny model's greedy continuations of training
    prompts; returns the saved directory and held-out, tie-free prompts (other seeds) for serving."""
    train_prompts = _tie_free_prompts(tiny_llama_dir, vocab_size, _greedy(), lens=[4, 7, 9, 12, 5, 8], seed=10)
    ids = greedy_continuations(base, torch.tensor([p[:4] for p in train_prompts]), 4 + 60)
    hidden = final_hidden_states(base, ids)
    heads.set_draft_vocab(frequent_tokens(head_targets(ids, NUM_HEADS)[1], vocab_size // 2))
    weight = base.get_output_embeddings().weight.detach().float()
    vocab = heads.draft_vocab
    train_heads(heads, lambda x: x @ weight[vocab].t(), hidden, ids,
                MedusaTrainConfig(steps=150, batch_size=128, lr=1e-2, warmup_steps=5), vocab=vocab)
    served_prompts = _tie_free_prompts(tiny_llama_dir, vocab_size, _greedy(NEW_TOKENS), lens=[5, 11, 6, 9], seed=3)
    return heads.save(out_dir), served_prompts
