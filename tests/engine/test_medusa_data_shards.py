"""Distillation data answered in shards (spec_decode/medusa_data_shards.py): the shards of a prompt list laid end to
end are the unsharded answers of the same list, a rerun answers only what no cache holds, training reads shards from
several cache directories, and bad settings are refused."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from pagellm.spec_decode import medusa_data_shards as S  # noqa: E402
from pagellm.spec_decode.medusa_train_data import (MedusaTrainConfig, answer_distill_prompts,  # noqa: E402
                                                   distill_prompt_ids, sharded_training_data)


def _config(**kw) -> MedusaTrainConfig:
    kw = {"data": "distill", "seq_len": 10, "num_train_seqs": 7, "num_eval_seqs": 3, "num_heads": 2,
          "sampled_fraction": 0.0, "shard_size": 3, **kw}
    return MedusaTrainConfig(**kw)


def test_parse_shards():
    assert S.parse_shards("all", 4) == [0, 1, 2, 3] and S.parse_shards(None, 2) == [0, 1]
    assert S.parse_shards("none", 4) == [] and S.parse_shards("0-1,3,1", 5) == [0, 1, 3]
    for bad in ("5", "2-1", "a", "0-9"):
        with pytest.raises(ValueError):
            S.parse_shards(bad, 5)


def test_concat_parts_shifts_each_parts_positions():
    def part(n, start):
        ids = torch.arange(start, start + n)[None]
        return ids, ids[..., None].expand(1, n, 4).to(torch.bfloat16), torch.arange(n - 3), ids + 100

    parts = [part(5, 0), part(7, 5), part(4, 12)]
    ids, hidden, pos, labels = S.concat_parts(parts)
    assert ids.tolist() == [list(range(16))] and labels.tolist() == [list(range(100, 116))]
    assert pos.tolist() == [0, 1, 5, 6, 7, 8, 12]
    assert torch.equal(hidden[0, :, 0].long(), ids[0]) and hidden.dtype == torch.bfloat16


def test_shards_laid_end_to_end_are_the_unsharded_answers(tiny_llama_dir, tiny_tokenizer, tmp_path):
    from pagellm.entrypoints.train_medusa import engine_recorder

    calls = []
    real = engine_recorder(str(tiny_llama_dir), "float32", 8, lambda _m: None)

    def record(prompts, answer_len, temperature):
        calls.append(len(prompts))
        return real(prompts, answer_len, temperature)

    config, say = _config(), (lambda _m: None)
    model, first, second = str(tiny_llama_dir), tmp_path / "a", tmp_path / "b"
    assert sharded_training_data([first], model, config, tiny_tokenizer, say, record, "1", load=False) is None
    assert calls == [3, 3]  # the held-out set, then shard 1 (prompts 3-5)
    with pytest.raises(ValueError, match="no held-out set or no shard"):
        S.load_shards([second], model, config, say)
    # another directory first: shard 1 and the held-out set are found in `first`, only shards 0 and 2 are answered
    data = sharded_training_data([second, first], model, config, tiny_tokenizer, say, record, "all")
    assert calls == [3, 3, 3, 1] and len(list(second.glob("medusa-shard-*.pt"))) == 2
    whole = answer_distill_prompts(distill_prompt_ids(tiny_tokenizer, config), config, False, say, real)
    ids, hidden, pos, labels = data[False]
    assert torch.equal(ids, whole[0]) and torch.equal(pos, whole[2]) and torch.equal(labels, whole[3])
    torch.testing.assert_close(hidden, whole[1], atol=2e-2, rtol=2e-2)  # other batches: the kernels' last bits
    assert data[True][0].shape[1] > 0 and data[True][1].dtype == torch.bfloat16
    # nothing left to answer: a third run only reads
    sharded_training_data([first, second], model, config, tiny_tokenizer, say, record, "all")
    assert len(calls) == 4


def test_bad_shard_settings_are_refused(tiny_tokenizer):
    with pytest.raises(ValueError, match="shard_size"):
        _config(shard_size=-1).check()
    with pytest.raises(ValueError, match="shard_size"):
        MedusaTrainConfig(data="chat", shard_size=4).check()
    with pytest.raises(ValueError, match="data cache"):
        S.answer_shards([], None, _config(), [0], lambda *_: (), lambda: [], lambda _m: None)
    with pytest.raises(ValueError, match="outside"):
        sharded_training_data(["/nonexistent"], None, _config(), tiny_tokenizer, lambda _m: None, None, "3")
