import random

import pytest

from pagellm.engine.detokenizer import IncrementalDetokenizer, StopStringChecker, decode_tokens, find_stop_string
from pagellm.engine.output_processor import OutputProcessor
from pagellm.sampling_params import SamplingParams

TEXTS = [
    "héllo wörld, naïve café",
    "日本語のテキスト and emoji 🙂🚀!",
    "The sea is wide. 🚀🚀 deep ümlauts",
]


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_never_split(tiny_tokenizer, text):
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.encode()) // 4  # byte-level pieces: characters span tokens
    detok = IncrementalDetokenizer(tiny_tokenizer, [tiny_tokenizer.bos_token_id])
    pieces = []
    for t in ids:
        d = detok.update([t])
        assert "\ufffd" not in d
        pieces.append(d)
    assert "".join(pieces) == text == decode_tokens(tiny_tokenizer, ids)


def test_random_token_streams_match_full_decode(tiny_tokenizer):
    rng = random.Random(0)
    V = len(tiny_tokenizer)
    for _ in range(50):
        prompt = tiny_tokenizer(rng.choice(TEXTS), add_special_tokens=False)["input_ids"]
        ids = [rng.randrange(5, V) for _ in range(rng.randrange(1, 30))]
        detok = IncrementalDetokenizer(tiny_tokenizer, prompt)
        for t in ids:
            detok.update([t])
        detok.flush()
        assert detok.output_text == decode_tokens(tiny_tokenizer, ids)


def test_find_stop_string():
    assert find_stop_string("abc STOP more", 9, ["STOP"], False) == ("STOP", 4)
    assert find_stop_string("abc STOP", 2, ["STOP"], True) == ("STOP", 8)
    assert find_stop_string("abc STO", 3, ["STOP"], False) is None
    # earliest of several
    assert find_stop_string("xx ab cd", 8, ["cd", "ab"], False) == ("ab", 3)


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_never_leak(tiny_tokenizer, include):
    """Random texts with stop strings, tokenized, streamed token by token: no streamed text ever
    shows anything after (or, unless included, of) the stop string."""
    rng = random.Random(1)
    alphabet = list("ab cdé🙂日\n.")
    stops = ["cd", "é🙂", "\n\n", "ab a"]
    for trial in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
        params = SamplingParams(stop=stops, include_stop_str_in_output=include, max_tokens=1000)
        params.update_from_generation_config([tiny_tokenizer.eos_token_id])
        op = OutputProcessor(tiny_tokenizer, max_model_len=10_000)
        st = op.add_request(str(trial), None, [1], params, 0.0)
        seq = st.seqs[0]
        # expected: earliest stop occurrence in the full text
        hits = [(text.find(s), s) for s in stops if s in text]
        streamed = []
        for t in ids:
            done = st.append_token(seq, t)
            streamed.append(st.make_output().outputs[0].text)
            if done:
                break
        final = streamed[-1]
        if hits:
            idx, s = min(hits)
            expected = text[: idx + (len(s) if include else 0)]
            assert seq.finish_reason == "stop" and seq.stop_reason == s
            assert final == expected
        else:
            assert seq.finish_reason is None and seq.stop_checker.text == text
            hold = 0 if include else max(map(len, stops)) - 1
            assert final == text[: max(0, len(text) - hold)]  # held back while it could start a stop
        for prev, cur in zip(streamed, streamed[1:]):
            assert cur.startswith(prev)  # streamed text only ever grows
        for s_text in streamed:
            assert final.startswith(s_text) or s_text == final


def test_stop_token_and_eos_not_in_text(tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    ids = tiny_tokenizer("hello", add_special_tokens=False)["input_ids"]
    params = SamplingParams(stop_token_ids=[ids[-1]], max_tokens=50)
    params.update_from_generation_config([eos])
    op = OutputProcessor(tiny_tokenizer, 100)
    st = op.add_request("a", None, [1], params, 0.0)
    for t in ids:
        st.append_token(st.seqs[0], t)
    out = st.make_output().outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == ids[-1]
    assert out.token_ids == ids and out.text == decode_tokens(tiny_tokenizer, ids[:-1])
    # min_tokens: EOS before min_tokens does not stop
    params = SamplingParams(min_tokens=3, max_tokens=50)
    params.update_from_generation_config([eos])
    st = op.add_request("b", None, [1], params, 0.0)
    assert not st.append_token(st.seqs[0], eos)
    assert not st.append_token(st.seqs[0], ids[0])
    assert st.append_token(st.seqs[0], eos)
    assert st.seqs[0].finish_reason == "stop" and st.seqs[0].stop_reason is None
    # max_tokens -> length
    st = op.add_request("c", None, [1], SamplingParams(max_tokens=2, ignore_eos=True), 0.0)
    assert not st.append_token(st.seqs[0], eos)
    assert st.append_token(st.seqs[0], eos)
    assert st.make_output().outputs[0].finish_reason == "length"
