import pytest
import torch

from engine.sampler import Sampler, token_logprobs
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
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logit_bias": {"7": 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_invalid_params_are_rejected_with_a_clear_error(kwargs, message):
    with pytest.raises(InvalidRequest, match=message):
        SamplingParams(**kwargs)


def test_a_single_stop_string_is_accepted():
    assert SamplingParams(stop="###").stop == ["###"]


def test_penalties_follow_vllm_on_the_rows_own_history():
    x = torch.zeros(1, VOCAB)
    x[0, 7], x[0, 8], x[0, 9] = 4.0, 3.0, -1.0
    greedy = SamplingParams(temperature=0)
    assert sample(x, [greedy]) == [7]
    # Repetition: a seen positive logit is divided (4 / 2 = 2 < 3), prompt tokens count too.
    rep = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert Sampler()(x, [rep], [0], [0], [([7], 1)]) == [8]
    # ... and a seen negative one multiplied: -2 * 2 falls below the unseen -3s.
    x2 = torch.full((1, VOCAB), -3.0)
    x2[0, 9] = -2.0
    assert Sampler()(x2, [rep], [0], [0], [([9], 1)]) != [9]
    # Frequency and presence count output tokens only: a prompt token is not penalized.
    freq = SamplingParams(temperature=0, frequency_penalty=0.4, presence_penalty=0.5)
    assert Sampler()(x, [freq], [0], [0], [([7, 7, 7], 3)]) == [7]
    # 4 - 0.4 * 1 - 0.5 = 3.1 > 3 after one output; 4 - 0.4 * 2 - 0.5 = 2.7 < 3 after two.
    assert Sampler()(x, [freq], [0], [1], [([1, 7], 1)]) == [7]
    assert Sampler()(x, [freq], [0], [2], [([1, 7, 7], 1)]) == [8]


def test_processed_rows_are_bit_identical_alone_and_in_a_batch():
    x = logits(5, seed=6)
    rows = [
        SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0.8, presence_penalty=-0.7, seed=3),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.2, logit_bias={3: 5.0, 11: -100.0}, min_tokens=4),
        SamplingParams(temperature=0.5),
    ]
    histories = [([1, 2, 3, 3, 4], 2), ([7, 7, 8], 1), ([1], 1), ([2, 3], 2), ([4, 4], 1)]
    seen = []
    sampler = Sampler(eos_token_ids=[0])
    for draw in range(30):
        batch = sampler(x, rows, [1, 2, 3, 4, 5], [draw] * 5, histories)
        alone = [sampler(x[i : i + 1], [rows[i]], [i + 1], [draw], [histories[i]])[0]
                 for i in range(5)]
        assert batch == alone
        seen.append(batch[3])
    assert 11 not in seen  # a -100 bias leaves the token out


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    x = torch.full((1, VOCAB), -5.0)
    x[0, 0] = 10.0  # EOS by far the most likely
    x[0, 1] = 9.0  # then a stop token id
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    sampler = Sampler(eos_token_ids=[0])
    assert sampler(x, [params], [0], [0], [([4], 1)]) != [0]
    assert sampler(x, [params], [0], [1], [([4, 5], 1)]) not in ([0], [1])
    assert sampler(x, [params], [0], [2], [([4, 5, 6], 1)]) == [0]


def test_logprobs_are_the_raw_log_softmax_and_row_invariant():
    x = logits(4, seed=8)
    entries = token_logprobs(x, [3, 4, 5, 6], [0, 2, 5, 1])
    reference = torch.log_softmax(x.double(), dim=-1)
    for row, (token, chosen, top) in enumerate(entries):
        assert token == 3 + row
        assert chosen == pytest.approx(float(reference[row, 3 + row]), abs=1e-5)
        assert [t for t, _ in top] == reference[row].argsort(descending=True)[: len(top)].tolist()
        alone = token_logprobs(x[row : row + 1], [3 + row], [len(top)])[0]
        assert alone == (token, chosen, top)  # bit for bit
    assert [len(top) for _, _, top in entries] == [0, 2, 5, 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_logits_are_processed_as_on_the_host_and_stay_row_invariant():
    from engine.sampler import process

    x = logits(5, seed=10)
    rows = [
        SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0.8, presence_penalty=-0.7, seed=3, top_p=0.8),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.2, logit_bias={3: 5.0, 11: -100.0}, min_tokens=4),
        SamplingParams(temperature=0.5, top_k=5, logprobs=3),
    ]
    histories = [([1, 2, 3, 3, 4], 2), ([7, 7, 8], 1), ([1], 1), ([2, 3], 2), ([4, 4], 1)]
    # Element-wise IEEE operations: the processed logits are the host's, bit for bit.
    on_host = process(x, rows, [0] * 5, histories, [0])
    assert torch.equal(process(x.cuda(), rows, [0] * 5, histories, [0]).cpu(), on_host)
    sampler = Sampler(eos_token_ids=[0])
    for draw in range(20):
        batch = sampler(x.cuda(), rows, [1, 2, 3, 4, 5], [draw] * 5, histories)
        alone = [sampler(x[i : i + 1].cuda(), [rows[i]], [i + 1], [draw], [histories[i]])[0]
                 for i in range(5)]
        assert batch == alone
        host = sampler(x, rows, [1, 2, 3, 4, 5], [draw] * 5, histories)
        assert [batch[i] for i in (0, 2)] == [host[i] for i in (0, 2)]  # greedy rows
    on_device = token_logprobs(x.cuda(), [1, 2, 3, 4, 5], [3] * 5)
    for (t, value, top), (t_host, value_host, top_host) in zip(
        on_device, token_logprobs(x, [1, 2, 3, 4, 5], [3] * 5), strict=True
    ):
        assert t == t_host and value == pytest.approx(value_host, abs=1e-5)
        assert [i for i, _ in top] == [i for i, _ in top_host]
