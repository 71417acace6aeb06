"""draw(): the two-stage categorical sampler that the loop and the verifier use, against its distribution;
Sampling.probs: temperature, top-k and top-p against distributions computed by hand."""

import math

import torch

from diversed.decoding.sampling import probabilities, sample_tokens
from diversed.request import Sampling
from diversed.verify import _BLOCK, draw

from test_verify import DRAWS, assert_distribution, random_dist

VOCAB = 2 * _BLOCK + 276  # three blocks, the last one partial


def test_draws_follow_the_distribution_across_blocks_and_never_take_a_zero():
    probs = random_dist(0, VOCAB, 4.0, support=slice(300, VOCAB - 7))  # zero mass in the first and last block
    g = torch.Generator().manual_seed(0)
    rows = 4000
    tokens = torch.cat([draw(probs.expand(rows, -1), g) for _ in range(DRAWS // rows)])
    assert_distribution(tokens, probs, "draw()")


def test_rows_are_drawn_from_their_own_unnormalised_weights():
    weights = torch.zeros(2, VOCAB)
    weights[0, 5], weights[1, VOCAB - 1] = 3.0, 0.5
    weights[1, _BLOCK] = 1.5
    g = torch.Generator().manual_seed(1)
    tokens = torch.stack([draw(weights, g) for _ in range(2000)])
    assert (tokens[:, 0] == 5).all()
    assert set(tokens[:, 1].tolist()) == {_BLOCK, VOCAB - 1}
    assert abs(float((tokens[:, 1] == _BLOCK).double().mean()) - 0.75) < 5 * (0.75 * 0.25 / 2000) ** 0.5


def test_temperature_top_k_and_top_p_against_hand_computed_distributions():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 3.0, 1.0]])

    def softmax_over(row: list[float], keep: list[int], t: float) -> torch.Tensor:
        weights = torch.tensor([math.exp(row[i] / t) if i in keep else 0.0 for i in range(len(row))])
        return weights / weights.sum()

    rows = logits.tolist()
    cases = {  # sampling -> the expected distribution of each row, written out from the definitions
        Sampling(0.5): [softmax_over(r, [0, 1, 2, 3], 0.5) for r in rows],
        Sampling(1.0, top_k=2): [softmax_over(rows[0], [0, 1], 1.0), softmax_over(rows[1], [1, 2], 1.0)],
        # Top-k keeps every token tied with the k-th: the second row's two 3.0s both stay at k = 1.
        Sampling(1.0, top_k=1): [softmax_over(rows[0], [0], 1.0), softmax_over(rows[1], [1, 2], 1.0)],
        # Row 1 at T = 1: p = 0.644, 0.237, 0.087, 0.032; top-p 0.7 keeps the tokens whose preceding mass is
        # under 0.7 (0, then 0.644): the first two. Row 2: 0.458, 0.458, 0.062, 0.023: the first two again.
        Sampling(1.0, top_p=0.7): [softmax_over(rows[0], [0, 1], 1.0), softmax_over(rows[1], [1, 2], 1.0)],
        Sampling(0.0): [softmax_over(r, [0, 1, 2, 3], 1.0) for r in rows],  # greedy: untempered, argmax drawn
    }
    for sampling, expected in cases.items():
        torch.testing.assert_close(probabilities(sampling, logits), torch.stack(expected), msg=str(sampling))
    assert sample_tokens(Sampling(0.0), probabilities(Sampling(0.0), logits), None).tolist() == [0, 1]
