"""Sampling through the screened LM head (`pegaserve/sample/screened.py`): greedy rows take
the full logits' argmax, plain sampled rows are drawn by rejection from upper bounds with the law of
the full logits, and a seeded row's token depends on nothing else in the step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pegaserve.cpu.lm_head import CpuLogits, ScreenedHead
from pegaserve.messages import SamplingParams
from pegaserve.sample import screened
from pegaserve.sample.processing import SamplingRow, edit_at
from pegaserve.sample.sampler import process_logits
from pegaserve.sample.screened import draws_by_rejection, sample_hidden
from tests.helpers import on_each_kernel_build
from tests.sample.test_sampler import chi_square

needs_kernel = on_each_kernel_build("the full logits sample every row")

VOCAB, HIDDEN = 3000, 64  # three 1024-token cells, the last one short
NUM_DRAWS, BATCH = 20_000, 2000
TOP = 15
CHI2_15_DOF = 37.70  # chi-square with 15 degrees of freedom exceeds this with probability 0.001


def _head(seed: int = 0) -> tuple[ScreenedHead, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator) * 0.5
    hidden = torch.randn(HIDDEN, generator=generator)
    return ScreenedHead.of(CpuLogits(weight)), hidden


def _row(seed: int | None, position: int = 3, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(seed=seed, **params), position)


class _FullLogits:
    """`sample_hidden`'s `full_logits`, counting the rows it was asked for."""

    def __init__(self, logits: CpuLogits) -> None:
        self.logits, self.rows = logits, 0

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        self.rows += hidden.shape[0]
        return self.logits(hidden)


def _draws(head: ScreenedHead, hidden: torch.Tensor, full: _FullLogits, **params) -> list[int]:
    tokens = []
    for first in range(0, NUM_DRAWS, BATCH):
        rows = [_row(seed, **params) for seed in range(first, first + BATCH)]
        found = sample_hidden(hidden.expand(BATCH, -1), list(range(BATCH)), rows, head, full)
        assert all(t.logprob is None and t.top_logprobs == () for t in found)
        tokens += [t.token_id for t in found]
    return tokens


def _binned_chi_square(tokens: list[int], logits: torch.Tensor, temperature: float) -> float:
    """Pearson's statistic over the TOP best tokens, one bin each, and one bin for the rest."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    best = probs.argsort(descending=True)[:TOP]
    binned = torch.full((VOCAB,), TOP)
    binned[best] = torch.arange(TOP)
    bin_probs = torch.zeros(TOP + 1, dtype=torch.float64).index_add_(0, binned, probs)
    assert bin_probs[:TOP].sum() > 0.3  # the bins hold much of the mass
    return chi_square(binned[torch.tensor(tokens)].tolist(), bin_probs)


@needs_kernel
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_draws_by_rejection_have_the_full_logits_law(temperature):
    head, hidden = _head()
    full = _FullLogits(head.logits)

    tokens = _draws(head, hidden, full, temperature=temperature)

    assert full.rows == 0  # every row settled by rejection
    assert _binned_chi_square(tokens, head.logits(hidden[None])[0], temperature) < CHI2_15_DOF


@needs_kernel
@pytest.mark.parametrize(("temperature", "proposals"), [(1.0, 3), (0.6, 3), (1.0, 1)])
def test_looser_bounds_reject_more_and_rows_left_over_take_the_full_logits_with_the_same_law(
    monkeypatch, temperature, proposals
):
    """Bounds 150x too wide are still bounds: most proposals are rejected, a row still rejected after
    MAX_PROPOSALS goes to the full logits, with uniforms its proposals did not read (after one
    rejected proposal, the first uniform would land it near the token just rejected), and the
    tokens keep the law."""
    head, hidden = _head(seed=1)
    head._bounds *= 150
    monkeypatch.setattr(screened, "MAX_PROPOSALS", proposals)
    monkeypatch.setattr(screened, "MAX_SLACK", float("inf"))  # keep the rows on the bounds
    full = _FullLogits(head.logits)

    tokens = _draws(head, hidden, full, temperature=temperature)

    assert NUM_DRAWS // 20 < full.rows < NUM_DRAWS  # both ways took rows
    assert _binned_chi_square(tokens, head.logits(hidden[None])[0], temperature) < CHI2_15_DOF


@needs_kernel
def test_a_row_left_to_its_full_logits_draws_with_uniforms_its_proposals_did_not_read(monkeypatch):
    """3 nats of slack on the runner-up alone: its proposals are mostly rejected, and with one
    proposal allowed those rows go to the full logits. Drawn there with the first uniform again,
    they would land on the runner-up (chi-square ~1500 here); with fresh ones the law holds."""
    head, hidden = _head(seed=1)
    logits = head.logits(hidden[None])[0]
    runner_up = int(logits.argsort(descending=True)[1])
    head._bounds[runner_up] += 3.0 / float(hidden.norm())
    monkeypatch.setattr(screened, "MAX_PROPOSALS", 1)
    monkeypatch.setattr(screened, "MAX_SLACK", float("inf"))
    full = _FullLogits(head.logits)

    tokens = _draws(head, hidden, full, temperature=1.0)

    assert full.rows > NUM_DRAWS // 4
    assert _binned_chi_square(tokens, logits, 1.0) < CHI2_15_DOF


@needs_kernel
def test_a_row_whose_bounds_are_loose_at_its_temperature_takes_the_full_logits():
    """The slack |x| * mean bound, over the temperature, decides (stretched by a repetition
    penalty): a cold row would be rejected again and again, so its full logits draw it at once."""
    head, hidden = _head(seed=4)
    slack = float(hidden.norm()) * head.mean_bound
    hot, cold = slack / (0.5 * screened.MAX_SLACK), slack / (2 * screened.MAX_SLACK)
    full = _FullLogits(head.logits)

    sample_hidden(hidden[None], [0], [_row(1, temperature=hot)], head, full)
    assert full.rows == 0
    sample_hidden(hidden[None], [0], [_row(1, temperature=cold)], head, full)
    assert full.rows == 1
    warm = slack / (0.7 * screened.MAX_SLACK)  # 0.7 of the slack allowed
    sample_hidden(hidden[None], [0], [_row(1, temperature=warm)], head, full)
    assert full.rows == 1
    for penalty in (2.0, 0.5):  # scales a logit by up to 2: twice the slack
        full.rows = 0
        sample_hidden(hidden[None], [0], [_row(1, temperature=warm, repetition_penalty=penalty)], head, full)
        assert full.rows == 1, penalty


def _processed_row(logits: torch.Tensor, seed: int, temperature: float) -> SamplingRow:
    """A row whose processing moves the mass every way it can: the best token masked, the next ones
    penalized (repetition over prompt and output, presence and frequency over the output), one of
    rank 20 lifted by a bias of +3 (above its bound: only processed bounds propose it often enough)
    and one of rank 3 lowered."""
    order = logits.argsort(descending=True).tolist()
    params = SamplingParams(
        seed=seed, temperature=temperature, presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3,
        logit_bias=((order[20], 3.0), (order[3], -1.5)),
    )
    output = (order[1], order[1], order[2], order[5], order[40])
    return SamplingRow(params, 3, masked_token_ids=frozenset({order[0]}), output_token_ids=output,
                       prompt_token_ids=(order[2], order[6], order[6]))


@needs_kernel
@pytest.mark.parametrize(("temperature", "looser", "proposals"), [(1.0, 1, 16), (0.7, 1, 16), (1.0, 150, 3)])
def test_processed_rows_drawn_by_rejection_have_the_processed_logits_law(monkeypatch, temperature, looser, proposals):
    """Bias, penalties and a min_tokens mask applied to the bounds and to the exact logit alike keep
    the law of the processed full logits; with bounds 150x too wide, rows left over to the full
    logits keep it too."""
    head, hidden = _head(seed=7)
    head._bounds *= looser
    monkeypatch.setattr(screened, "MAX_PROPOSALS", proposals)
    monkeypatch.setattr(screened, "MAX_SLACK", float("inf") if looser > 1 else screened.MAX_SLACK)
    logits = head.logits(hidden[None])[0]
    full = _FullLogits(head.logits)
    tokens = []
    for first in range(0, NUM_DRAWS, BATCH):
        rows = [_processed_row(logits, seed, temperature) for seed in range(first, first + BATCH)]
        assert all(draws_by_rejection(row, VOCAB) for row in rows)
        tokens += [t.token_id for t in sample_hidden(hidden.expand(BATCH, -1), list(range(BATCH)), rows, head, full)]

    processed = process_logits(logits[None], [_processed_row(logits, 0, temperature)])[0]
    assert (full.rows == 0) == (looser == 1)
    assert int(logits.argmax()) not in tokens  # masked
    assert _binned_chi_square(tokens, processed, temperature) < CHI2_15_DOF


@needs_kernel
def test_rows_with_allowed_token_ids_drawn_by_rejection_keep_to_them_with_the_masked_logits_law():
    head, hidden = _head(seed=8)
    logits = head.logits(hidden[None])[0]
    order = logits.argsort(descending=True).tolist()
    allowed = frozenset(order[2:40:2] + order[1000:1003])  # every other one of the best, three unlikely ones
    full = _FullLogits(head.logits)
    tokens = _draws(head, hidden, full, allowed_token_ids=allowed)
    assert full.rows == 0 and set(tokens) <= allowed
    masked = torch.full_like(logits, float("-inf"))
    masked[list(allowed)] = logits[list(allowed)]
    assert _binned_chi_square(tokens, masked, 1.0) < CHI2_15_DOF


def test_edit_at_is_the_full_rows_processing_at_each_column():
    """The one-column processing the rejection draw checks a proposal with is the same float as the
    whole row's, at every column of rows with every kind of processing (and of none)."""
    generator = torch.Generator().manual_seed(9)
    logits = torch.randn(6, 300, generator=generator) * 4
    logits[:, :3] = torch.tensor([0.0, -0.0, float("-inf")])
    rows = [_processed_row(logits[0], 1, 1.0), _row(2),
            SamplingRow(SamplingParams(repetition_penalty=0.7, logit_bias=((4, 0.1), (4, 0.2))), 5,
                        prompt_token_ids=(4, 4, 9, 1), output_token_ids=(0, 2)),
            SamplingRow(SamplingParams(frequency_penalty=-0.3, presence_penalty=1e-8), 2,
                        masked_token_ids=frozenset({7, 8}), output_token_ids=(7, 9, 9, 9, 11)),
            SamplingRow(SamplingParams(allowed_token_ids=frozenset({0, 2, 7, 40, 41}), logit_bias=((40, 1.0),)), 1,
                        masked_token_ids=frozenset({7})),
            SamplingRow(SamplingParams(logit_bias=((33, 1.0),)), 1,  # a grammar's bitmask: tokens 1, 3, 32-63, 299
                        token_bitmask=torch.tensor([0b1010, -1, 0, 0, 0, 0, 0, 0, 0, 1 << 11], dtype=torch.int32))]
    processed = process_logits(logits, rows)
    columns = list(range(logits.shape[1]))
    for i, row in enumerate(rows):
        at = edit_at(logits[i], columns, [row] * len(columns))
        assert torch.equal(at, processed[i]), i


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_a_seeded_rows_token_does_not_depend_on_the_rest_of_the_step(threads):
    """The same seeded rows alone, then among greedy rows, rows with logprobs (the full logits' path)
    and other sampled rows, on one or two threads: the same tokens."""
    head, _ = _head(seed=2)
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(12, HIDDEN, generator=generator)
    seeded = [_row(100 + i) for i in range(4)]
    others = [_row(None, temperature=0.0), _row(7, num_top_logprobs=2), _row(None), _row(9, top_p=0.5)] * 2
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        alone = sample_hidden(hidden[:4], [0, 1, 2, 3], seeded, head, head.logits)
        mixed = sample_hidden(hidden, list(range(12)), seeded + others, head, head.logits)
        reordered = sample_hidden(hidden.flip(0), list(range(12)), (seeded + others)[::-1], head, head.logits)
    finally:
        torch.set_num_threads(before)

    tokens = [t.token_id for t in alone]
    assert [t.token_id for t in mixed[:4]] == tokens
    assert [t.token_id for t in reordered[::-1][:4]] == tokens
    assert mixed[5].logprob is not None and len(mixed[5].top_logprobs) == 2  # its path gave it its logprobs
    assert mixed[4].token_id == int(head.logits(hidden[4:5]).argmax())


@needs_kernel
def test_rows_sharing_a_position_and_greedy_steps():
    """Two rows of one position (`row_of`) get that position's hidden state; a step of greedy rows
    alone takes the screened argmax, which is the full logits' argmax."""
    head, _ = _head(seed=3)
    hidden = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(6))
    greedy = [_row(None, temperature=0.0)] * 4
    full = _FullLogits(head.logits)

    tokens = sample_hidden(hidden, [0, 0, 2, 1], greedy, head, full)

    argmax = head.logits(hidden).argmax(-1).tolist()
    assert [t.token_id for t in tokens] == [argmax[0], argmax[0], argmax[2], argmax[1]] and full.rows == 0
    twice = sample_hidden(hidden, [1, 1], [_row(11), _row(11)], head, full)
    assert twice[0] == twice[1] and full.rows == 0


def test_which_rows_are_drawn_by_rejection():
    for row in (
        _row(None),
        _row(1, temperature=0.3),
        _row(1, top_k=VOCAB),  # a top-k over the whole vocab filters nothing
        _row(None, presence_penalty=0.5),  # processing is applied to the bounds
        _row(None, repetition_penalty=1.2),
        _row(None, logit_bias=((5, 1.0),)),
        SamplingRow(SamplingParams(), 3, masked_token_ids=frozenset({7})),
        SamplingRow(SamplingParams(), 3, draft_token_id=5),  # a draft changes no draw
        _row(None, position=0),  # a choice's first token too: it wants no logprob unless asked
    ):
        assert draws_by_rejection(row, VOCAB), row
    for row in (
        _row(None, temperature=0.0),  # greedy: the screened argmax
        _row(None, temperature=0.0, presence_penalty=0.5),
        _row(None, num_top_logprobs=0),
        _row(None, top_p=0.9),
        _row(None, top_k=50),
        _row(None, min_p=0.1),
        _row(None, presence_penalty=0.5, top_p=0.9),
    ):
        assert not draws_by_rejection(row, VOCAB), row


def test_without_a_screened_head_every_row_takes_the_full_logits():
    weight = torch.randn(500, 32, generator=torch.Generator().manual_seed(4))
    hidden = torch.randn(2, 32, generator=torch.Generator().manual_seed(8))
    full = _FullLogits(CpuLogits(weight, allow_kernel=False))

    tokens = sample_hidden(hidden, [0, 1], [_row(1), _row(None, temperature=0.0)], None, full)

    assert full.rows == 2 and tokens[1].token_id == int(full.logits(hidden[1:]).argmax())


def test_a_rows_stream_shifts_its_uniforms_and_stream_zero_is_the_draws_own():
    from pegaserve.sample.draw import mix64, uniform  # noqa: PLC0415

    row = _row(7, position=5)
    assert uniform(row) == (mix64(mix64(7) ^ 5) >> 11) * 2.0**-53  # the hash every draw used before
    assert uniform(dataclasses.replace(row, stream=32)) == uniform(row, 32) != uniform(row)
    assert uniform(dataclasses.replace(row, stream=32), 1) == uniform(row, 33)
