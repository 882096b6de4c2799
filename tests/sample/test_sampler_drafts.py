"""Speculative drafts at the sampler: a draft changes no draw (the scheduler accepts it when the draw
is the draft), so it is accepted with probability p(draft), the tokens stay distributed as p, a
greedy row and a masked draft are unaffected, and draws stay exact across the inverse CDF's cells.
Fixed seed sets, so each statistic is one number: the tests are deterministic, not flaky."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from pegaserve.sample.sampler import sample
from tests.sample.test_sampler import (
    CHI2_7_DOF,
    CHI2_8_DOF,
    DRAFT_PROBS,
    NUM_DRAWS,
    chi_square,
    drawn,
    frequencies,
    random_logits,
    row,
)


@pytest.mark.parametrize("draft", [0, 7, None], ids=["likely-draft", "unlikely-draft", "no-draft"])
def test_with_a_draft_the_tokens_are_still_distributed_as_p(draft):
    tokens = drawn(DRAFT_PROBS.log(), NUM_DRAWS, draft=draft)
    assert chi_square(tokens, DRAFT_PROBS) < CHI2_7_DOF
    assert (frequencies(tokens, 8) - DRAFT_PROBS.double()).abs().max() < 0.01  # ~3 standard deviations


@pytest.mark.parametrize("draft", [0, 3, 7])
def test_a_draft_is_accepted_with_probability_p_draft(draft):
    tokens = drawn(DRAFT_PROBS.log(), NUM_DRAWS, draft=draft)
    p = DRAFT_PROBS[draft].item()
    accepted = sum(t == draft for t in tokens) / NUM_DRAWS
    assert abs(accepted - p) < 4 * math.sqrt(p * (1 - p) / NUM_DRAWS)


def test_a_draft_changes_no_draw():
    # the row draws as without its draft (the scheduler accepts the draft when the draw is the draft),
    # so a seeded request's tokens are the same with speculation or a prediction, and without
    plain = drawn(DRAFT_PROBS.log(), 2000)
    for draft in (0, 1, 7):
        assert drawn(DRAFT_PROBS.log(), 2000, draft=draft) == plain
    logits = random_logits(4, vocab=151936, scale=3.0, seed=21)
    for params in ({"seed": 3}, {"seed": 4, "top_p": 0.9}, {"seed": 5, "presence_penalty": 0.5}):
        rows = [row(num_output_tokens=k, output=(7,), **params) for k in range(4)]
        with_drafts = [replace(r, draft_token_id=d) for r, d in zip(rows, (0, 9, 151935, None))]
        assert sample(logits, with_drafts) == sample(logits, rows), params


def test_a_greedy_row_ignores_its_draft_and_a_masked_draft_is_never_accepted():
    logits = DRAFT_PROBS.log()
    assert sample(logits[None], [row(temperature=0.0, draft=5)])[0].token_id == 0
    tokens = drawn(logits, NUM_DRAWS, draft=0, masked=frozenset({0}))
    renormalized = DRAFT_PROBS.clone()
    renormalized[0] = 0.0
    assert chi_square(tokens, renormalized / renormalized.sum()) < CHI2_7_DOF  # 0 is never drawn


@pytest.mark.parametrize("draft", [None, 1024, 5], ids=["no-draft", "heavy-draft-on-a-cell-edge", "light-draft"])
def test_draws_are_exact_across_the_inverse_cdfs_cells(draft):
    # 3000 tokens: three 1024-token cells, the last one short. Eight tokens on cell edges hold 90%.
    vocab, heavy = 3000, [0, 1023, 1024, 1500, 2047, 2048, 2998, 2999]
    probs = torch.full((vocab,), 0.1 / (vocab - len(heavy)), dtype=torch.float64)
    probs[heavy] = torch.tensor([0.2, 0.15, 0.15, 0.1, 0.1, 0.1, 0.05, 0.05], dtype=torch.float64)
    tokens = torch.tensor(drawn(probs.float().log(), NUM_DRAWS, draft=draft))
    binned = torch.full((vocab,), len(heavy))  # every light token in one bin
    binned[heavy] = torch.arange(len(heavy))
    bin_probs = torch.zeros(len(heavy) + 1, dtype=torch.float64).index_add_(0, binned, probs)
    assert chi_square(binned[tokens].tolist(), bin_probs) < CHI2_8_DOF
