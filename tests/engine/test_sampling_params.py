import math

import pytest

from pagellm.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=math.nan), "top_p"),
    (dict(n=0), "n"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.1), "min_p"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=10, max_tokens=5), "min_tokens"),
    (dict(logprobs=-1), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(logprobs_mode="weird"), "logprobs_mode"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(logit_bias={1: 1000.0}), "logit_bias"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_defaults_and_normalization():
    p = SamplingParams()
    assert p.max_tokens == 16 and p.n == 1 and p.temperature == 1.0 and p.top_k == -1
    assert SamplingParams(top_k=0).top_k == -1
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(temperature=0).is_greedy
    p = SamplingParams(stop_token_ids=[5])
    p.update_from_generation_config([2])
    assert p.all_stop_token_ids == {2, 5}
    p = SamplingParams(ignore_eos=True)
    p.update_from_generation_config([2])
    assert p.all_stop_token_ids == set()
