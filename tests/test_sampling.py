"""draw(): the two-stage categorical sampler that the loop and the verifier use, against its distribution."""

import torch

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
