"""Sampling and scoring where the logits are (sampling_device.py): the plain rows on the logits' device,
the rest through `sample()` on the CPU; prompt scores in torch ops. `sample_split` and `score_torch` are
the GPU's routes on any device, so every test runs on the CPU too; with CUDA the same tests run on the
GPU (skipped without one, saying so).

The reference is `sample()` itself: greedy rows and their logprobs agree with it, a seeded draw picks
the same token but where its uniform falls within rounding of a boundary (the module's docstring), and
rows with processing, filters or a draft are `sample()`'s own.
"""

import pytest
import torch

from pegaserve.sample.on_device import sample_on_device, sample_split, score_on_device, score_torch
from pegaserve.sample.sampler import sample, score_tokens
from tests.sample.test_sampler import CHI2_7_DOF, DRAFT_PROBS, NUM_DRAWS, chi_square, random_logits, row

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU route on a GPU needs CUDA")
    ),
]


def split(logits: torch.Tensor, rows, device: str):
    return sample_split(logits.to(device), rows)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_take_the_argmax_with_the_raw_logprobs(device):
    logits = random_logits(8, vocab=5000)
    rows = [row(temperature=0.0, num_top_logprobs=n) for n in (0, 1, 3, 5, 0, 2, 0, 20)]
    rows[4] = row(temperature=0.0, num_top_logprobs=3, logprob_token_ids=(4999, 3, 17))  # listed, not the best
    got, want = split(logits, rows, device), sample(logits, rows)
    assert [i for i, _ in got[4].top_logprobs] == [4999, 3, 17]
    assert [t.token_id for t in got] == [t.token_id for t in want] == logits.argmax(-1).tolist()
    for g, w in zip(got, want):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert [i for i, _ in g.top_logprobs] == [i for i, _ in w.top_logprobs]
        assert [lp for _, lp in g.top_logprobs] == pytest.approx([lp for _, lp in w.top_logprobs], abs=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_a_seeded_row_draws_what_sample_draws(device, temperature):
    # 160k tokens: the real vocabulary's width, and sample()'s cells of 1024 with a short last one
    logits = random_logits(64, vocab=160_000, seed=1)
    rows = [row(seed=seed, num_output_tokens=seed % 7, temperature=temperature, num_top_logprobs=0)
            for seed in range(64)]
    got, want = split(logits, rows, device), sample(logits, rows)
    mismatches = sum(g.token_id != w.token_id for g, w in zip(got, want))
    assert mismatches <= 1  # a uniform within float32 rounding of a boundary: ~1e-5 per draw
    assert [g.logprob for g in got] == pytest.approx([w.logprob for w in want], abs=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_a_seeded_row_draws_the_same_token_whatever_else_is_in_the_batch(device):
    logits = random_logits(16, vocab=3000, seed=2)
    rows = [row(seed=100 + i, temperature=0.0 if i % 3 == 1 else 0.8) for i in range(16)]  # greedy among them
    batched = split(logits, rows, device)
    assert [batched[i].token_id for i in range(1, 16, 3)] == logits[1::3].argmax(-1).tolist()
    for i in (0, 7, 15):
        alone = split(logits[i : i + 1], [rows[i]], device)[0]
        assert alone.token_id == batched[i].token_id
        assert alone.logprob == pytest.approx(batched[i].logprob, abs=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_draws_are_distributed_as_the_softmax_at_the_temperature(device):
    logits = DRAFT_PROBS.log() * 0.7  # divided by temperature 0.7: DRAFT_PROBS again
    tokens = []
    for first in range(0, NUM_DRAWS, 4096):
        rows = [row(seed=seed, temperature=0.7) for seed in range(first, min(first + 4096, NUM_DRAWS))]
        tokens += [t.token_id for t in split(logits.expand(len(rows), -1).contiguous(), rows, device)]
    assert chi_square(tokens, DRAFT_PROBS) < CHI2_7_DOF


@pytest.mark.parametrize("device", DEVICES)
def test_tokens_far_below_the_best_are_never_drawn(device):
    logits = torch.full((1, 4000), -1000.0)
    logits[0, [3, 2500]] = torch.tensor([0.0, -1.0])
    logits[0, 100] = float("-inf")
    rows = [row(seed=seed) for seed in range(200)]
    tokens = {t.token_id for t in split(logits.expand(200, -1).contiguous(), rows, device)}
    assert tokens == {3, 2500}


@pytest.mark.parametrize("device", DEVICES)
def test_rows_with_processing_or_filters_are_sample_s_own(device):
    logits = random_logits(9, vocab=3000, seed=3)
    rows = [
        row(seed=1, presence_penalty=1.5, output=(4, 4, 9)),
        row(temperature=0.0, logit_bias=((17, 50.0),)),
        row(seed=2, top_p=0.5),
        row(seed=3, top_k=20),
        row(seed=4, min_p=0.1),
        row(seed=5, min_p=0.05),
        row(seed=6, masked=frozenset({int(logits[6].argmax())}), temperature=0.0),
        row(seed=7, repetition_penalty=1.3, prompt=(1, 2, 3), output=(5,)),
        row(temperature=0.0, top_k=1, draft=3),  # greedy (top_k 1): plain, as every draft is
    ]
    got, want = split(logits, rows, device), sample(logits, rows)
    assert got[:-1] == want[:-1]
    assert got[-1].token_id == want[-1].token_id and got[-1].logprob == pytest.approx(want[-1].logprob, abs=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_top", [0, 4])
def test_prompt_scores_are_score_tokens_own(device, num_top):
    logits = random_logits(70, vocab=151_936, scale=4.0, seed=5)
    logits[3, :10] = logits[3, 10]  # ties: ranked together
    targets = torch.randint(0, 151_936, (70,), generator=torch.Generator().manual_seed(6)).tolist()
    targets[3] = 10
    got, want = score_torch(logits.to(device), targets, num_top), score_tokens(logits, targets, num_top)
    assert [(g.token_id, g.rank) for g in got] == [(w.token_id, w.rank) for w in want]
    assert [g.logprob for g in got] == pytest.approx([w.logprob for w in want], abs=1e-4)
    for g, w in zip(got, want):
        assert [i for i, _ in g.top_logprobs] == [i for i, _ in w.top_logprobs]
        assert [lp for _, lp in g.top_logprobs] == pytest.approx([lp for _, lp in w.top_logprobs], abs=1e-4)
    assert score_torch(logits[:0].to(device), [], num_top) == []


def test_on_the_cpu_they_are_sample_and_score_tokens_themselves():
    logits = random_logits(4, vocab=2000, seed=4)
    rows = [row(seed=i, temperature=0.9) for i in range(4)]
    assert sample_on_device(logits, rows) == sample(logits, rows)
    assert score_on_device(logits, [1, 2, 3, 4], 2) == score_tokens(logits, [1, 2, 3, 4], 2)
