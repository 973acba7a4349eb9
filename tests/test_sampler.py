import pytest
import torch

from engine.sampler import Sampler
from engine.sampling import InvalidRequest, SamplingParams

VOCAB = 50


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def sample(x: torch.Tensor, params: list[SamplingParams], seeds=None, indices=None) -> list[int]:
    n = len(params)
    return Sampler()(x, params, seeds or [0] * n, indices or [0] * n)


def test_greedy_is_argmax_of_fp32_logits():
    x = logits(4).to(torch.bfloat16)
    assert sample(x, [SamplingParams(temperature=0)] * 4) == x.float().argmax(-1).tolist()


def test_a_row_does_not_depend_on_the_rest_of_the_batch():
    x = logits(6)
    mine = SamplingParams(temperature=1.0, seed=5)
    alone = [sample(x[2:3], [mine], [5], [i])[0] for i in range(20)]
    others = [SamplingParams(temperature=0.7, top_p=0.5), SamplingParams(temperature=0),
              SamplingParams(temperature=1.3, top_k=3), SamplingParams(temperature=0.2),
              SamplingParams(temperature=1.0)]
    params = [*others[:2], mine, *others[2:]]
    in_batch = [sample(x, params, [1, 2, 5, 3, 4, 6], [i, 0, i, 7, 8, 9])[2] for i in range(20)]
    assert alone == in_batch
    assert len(set(alone)) > 1  # it really samples


def test_the_same_seed_and_index_give_the_same_token_and_indices_differ():
    x = logits(1)
    p = SamplingParams(temperature=1.5)
    draws = [sample(x, [p], [42], [i])[0] for i in range(30)]
    assert draws == [sample(x, [p], [42], [i])[0] for i in range(30)]
    assert len(set(draws)) > 3


def test_sampling_follows_the_softmax():
    x = logits(1, seed=3)[0]
    p = SamplingParams(temperature=2.0)
    n = 4000
    counts = torch.bincount(
        torch.tensor([sample(x.unsqueeze(0), [p], [s], [0])[0] for s in range(n)]),
        minlength=VOCAB,
    ).float()
    expected = torch.softmax(x / 2.0, dim=-1) * n
    top = expected.argsort(descending=True)[:5]
    # Frequencies within 5 standard deviations of the binomial expectation.
    sd = (expected[top] * (1 - expected[top] / n)).sqrt()
    assert ((counts[top] - expected[top]).abs() < 5 * sd).all()


def test_top_k_and_top_p_restrict_the_choices():
    x = logits(1, seed=1)
    order = x[0].argsort(descending=True).tolist()
    top2 = {sample(x, [SamplingParams(temperature=5.0, top_k=2)], [s], [0])[0] for s in range(200)}
    assert top2 == set(order[:2])
    probs = torch.softmax(x[0], dim=-1)
    nucleus = {sample(x, [SamplingParams(temperature=1.0, top_p=float(probs.max()) / 2)],
                      [s], [0])[0] for s in range(50)}
    assert nucleus == {order[0]}  # the top token alone carries more than top_p


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"stop": [""]}, "stop"),
        ({"stop": [1, 2]}, "stop"),
        ({"stop": None}, "stop"),
        ({"stop_token_ids": ["x"]}, "stop_token_ids"),
        ({"seed": -1}, "seed"),
    ],
)
def test_invalid_params_are_rejected_with_a_clear_error(kwargs, message):
    with pytest.raises(InvalidRequest, match=message):
        SamplingParams(**kwargs)


def test_a_single_stop_string_is_accepted():
    assert SamplingParams(stop="###").stop == ["###"]
