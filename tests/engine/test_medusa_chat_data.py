"""`pagellm train-medusa --data chat` (spec_decode/medusa_chat_data.py, medusa_train_data.chat_training_data): the
questions, the model's own answers (batched with left padding = each prompt answered alone), the trained
positions of ragged turns laid end to end, and a short end-to-end training run on a tiny random Llama."""

from __future__ import annotations

import random

import pytest
import torch

from pagellm.spec_decode.medusa_chat_data import HELD_OUT_TOPICS, TOPICS, chat_prompt_ids, chat_questions
from pagellm.spec_decode.medusa_train import MedusaTrainConfig, head_targets, train_medusa
from pagellm.spec_decode.medusa_train_data import (
    chat_answers,
    chat_training_data,
    final_hidden_states,
    ragged_positions,
)


@pytest.fixture(scope="module")
def hf_base(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval().requires_grad_(False)


def test_questions_are_seeded_and_held_out_topics_are_unseen():
    train = chat_questions(300, held_out=False, seed=3)
    assert train == chat_questions(300, held_out=False, seed=3) and len(train) == 300
    assert train != chat_questions(300, held_out=False, seed=4)
    held = chat_questions(40, held_out=True, seed=3)
    assert all(any(t in q for t in HELD_OUT_TOPICS) for q in held)
    assert not any(t in q for q in train for t in HELD_OUT_TOPICS)
    assert not set(TOPICS) & set(HELD_OUT_TOPICS)


def test_ragged_positions_stay_inside_their_turn():
    rng = random.Random(0)
    heads = 3
    lengths = [rng.randrange(1, 40) for _ in range(30)]
    starts = [rng.randrange(0, n + 1) for n in lengths]
    pos = ragged_positions(lengths, starts, heads)
    owner = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    offsets = torch.tensor([0] + lengths).cumsum(0)[:-1]
    for k in range(heads + 2):  # the position itself, the base's label t + 1 and every head's t + k + 2
        assert torch.equal(owner[pos + k], owner[pos])
    local = pos - offsets[owner[pos]]
    assert bool((local >= torch.tensor(starts)[owner[pos]]).all())
    assert len(pos) == sum(max(0, n - heads - 1 - s) for n, s in zip(lengths, starts))
    ids = torch.arange(sum(lengths))[None]
    flat, labels = head_targets(ids, heads, pos)
    assert torch.equal(labels, pos[:, None] + 2 + torch.arange(heads)[None])


def test_batched_answers_equal_each_prompt_answered_alone(hf_base, tiny_tokenizer):
    prompts = chat_prompt_ids(tiny_tokenizer, chat_questions(5, held_out=False, seed=1))
    assert len({len(p) for p in prompts}) > 1  # left padding is exercised
    batched = chat_answers(hf_base, tiny_tokenizer, prompts, answer_len=12, batch=5)
    eos = tiny_tokenizer.eos_token_id
    for p, seq in zip(prompts, batched):
        alone = chat_answers(hf_base, tiny_tokenizer, [p], answer_len=12, batch=1)[0]
        assert seq == alone and seq[: len(p)] == p
        answer = seq[len(p):]
        assert 1 <= len(answer) <= 12 and eos not in answer[:-1]  # cut after the first EOS, if any


def test_chat_training_data_lays_turns_end_to_end(hf_base, tiny_tokenizer):
    config = MedusaTrainConfig(data="chat", seq_len=10, num_train_seqs=3, num_heads=2)
    ids, hidden, pos = chat_training_data(hf_base, tiny_tokenizer, config, held_out=False, say=lambda _m: None)
    assert ids.shape[0] == 1 and hidden.shape[:2] == ids.shape and len(pos) > 0
    prompts = chat_prompt_ids(tiny_tokenizer, chat_questions(3, held_out=False, seed=config.seed))
    first = chat_answers(hf_base, tiny_tokenizer, prompts[:1], answer_len=10)[0]
    assert ids[0, : len(first)].tolist() == first  # the first turn, then the next ones
    torch.testing.assert_close(hidden[0, : len(first)], final_hidden_states(hf_base, torch.tensor([first]))[0])
    assert int(pos.min()) == len(prompts[0]) - 1  # training starts at the prompt's last token


def test_train_medusa_on_chat_turns_writes_heads(tmp_path, tiny_llama_dir):
    config = MedusaTrainConfig(data="chat", seq_len=12, num_train_seqs=6, num_eval_seqs=2, steps=5, num_heads=2)
    out, acc = train_medusa(tmp_path / "heads", str(tiny_llama_dir), config)
    assert (out / "medusa_config.json").is_file()
    assert set(acc) == {"base", "head1", "head2", "chain_head1", "chain_accepted_len"}
    assert all(0.0 <= acc[k] <= 1.0 for k in ("base", "head1", "head2", "chain_head1"))
    assert 1.0 <= acc["chain_accepted_len"] <= 1.0 + config.num_heads


def test_engine_answers_equal_hf_greedy_answers(hf_base, tiny_tokenizer, tiny_llama_dir):
    from pagellm.entrypoints.train_medusa import engine_answers

    prompts = chat_prompt_ids(tiny_tokenizer, chat_questions(4, held_out=True, seed=2))
    got = engine_answers(str(tiny_llama_dir), "float32")(prompts, 10)
    assert got == chat_answers(hf_base, tiny_tokenizer, prompts, answer_len=10)


def test_answer_fn_that_drops_the_prompt_is_refused(hf_base, tiny_tokenizer):
    config = MedusaTrainConfig(data="chat", seq_len=8, num_train_seqs=2, num_heads=2)
    with pytest.raises(ValueError, match="answer_fn"):
        chat_training_data(hf_base, tiny_tokenizer, config, held_out=False, say=lambda _m: None,
                           answer_fn=lambda prompts, n: [[1, 2, 3] for _ in prompts])
