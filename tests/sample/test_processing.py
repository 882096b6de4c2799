"""The sampler's processing — penalties, logit_bias, min_p, their order with the min_tokens mask —
and prompt scoring, against references spelled out one token at a time on small vocabularies."""

import math
from collections import Counter

import pytest
import torch

from pegaserve.messages import SamplingParams
from pegaserve.sample.processing import SamplingRow, bad_word_bans
from pegaserve.sample.sampler import process_logits, sample, score_tokens
from tests.sample.test_sampler import CHI2_7_DOF, chi_square, drawn, random_logits, row

INF = float("inf")


def reference(logits: list[float], r: SamplingRow) -> list[float]:
    """vLLM's order: allowed_token_ids, bias, mask, repetition (prompt + output, each token once),
    then frequency and presence (output only)."""
    x, p = list(logits), r.params
    if p.allowed_token_ids is not None:
        x = [v if t in p.allowed_token_ids else -INF for t, v in enumerate(x)]
    for token_id, bias in p.logit_bias:
        x[token_id] += bias
    for token_id in r.masked_token_ids:
        x[token_id] = -INF
    for token_id in set(r.prompt_token_ids) | set(r.output_token_ids):
        x[token_id] = x[token_id] / p.repetition_penalty if x[token_id] > 0 else x[token_id] * p.repetition_penalty
    for token_id, count in Counter(r.output_token_ids).items():
        x[token_id] -= p.frequency_penalty * count
        x[token_id] -= p.presence_penalty
    return x


def assert_processed_like_the_reference(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    processed = process_logits(logits, rows)
    for i, r in enumerate(rows):
        assert processed[i].tolist() == pytest.approx(reference(logits[i].tolist(), r), rel=1e-6, abs=1e-6)


def random_ids(count: int, vocab: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist())


PENALTIES = {
    "presence": {"presence_penalty": 0.7},
    "negative-presence": {"presence_penalty": -0.4},
    "frequency": {"frequency_penalty": 0.3},
    "repetition": {"repetition_penalty": 1.3},
    "repetition-below-1": {"repetition_penalty": 0.6},
    "combined": {"presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.2},
    "combined-with-bias-and-mask": {
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "repetition_penalty": 1.2,
        "logit_bias": ((3, 2.5), (5, -1.0)),
    },
    "allowed-with-penalties-bias-and-mask": {
        "repetition_penalty": 0.8,
        "frequency_penalty": 0.5,
        "logit_bias": ((3, 2.5), (4, -1.0)),
        "allowed_token_ids": frozenset({1, 3, 4, 5, 9}),
    },
}


@pytest.mark.parametrize("params", PENALTIES.values(), ids=PENALTIES.keys())
def test_each_penalty_matches_the_reference(params):
    logits = random_logits(6, vocab=12, scale=2.0, seed=11)  # positive and negative logits
    masked = frozenset({5}) if "logit_bias" in params else frozenset()
    rows = [row(output=random_ids(n, 12, seed=n), prompt=random_ids(4, 12, seed=50 + n), masked=masked, **params)
            for n in range(6)]  # fmt: skip
    rows[0] = row(**params)  # no history: nothing to penalize
    assert_processed_like_the_reference(logits, rows)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_once_per_token():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.0, 3.0]])
    (processed,) = process_logits(logits, [row(output=(1, 1, 3), prompt=(0, 1), repetition_penalty=2.0)])
    assert processed.tolist() == [1.0, -4.0, 1.0, 0.0, 3.0]  # token 1, seen three times, once


def test_frequency_and_presence_penalties_count_the_output_only():
    logits = torch.zeros(1, 5)
    r = row(output=(2, 2, 2, 4), prompt=(0, 0), frequency_penalty=0.5, presence_penalty=1.0)
    assert process_logits(logits, [r])[0].tolist() == [0.0, 0.0, -2.5, 0.0, -1.5]


def test_greedy_picks_follow_the_penalized_logits():
    # many small random cases in one batch: the penalties often move the argmax
    vocab, num_rows = 8, 300
    logits = random_logits(num_rows, vocab=vocab, scale=1.0, seed=12)
    rows = []
    for n in range(num_rows):
        knobs = torch.rand(3, generator=torch.Generator().manual_seed(n)).tolist()
        rows.append(row(output=random_ids(n % 7, vocab, seed=n), prompt=random_ids(3, vocab, seed=1000 + n),
                        temperature=0.0, presence_penalty=knobs[0], frequency_penalty=knobs[1] / 2,
                        repetition_penalty=1.0 + knobs[2]))  # fmt: skip
    expected = [max(range(vocab), key=reference(logits[i].tolist(), r).__getitem__) for i, r in enumerate(rows)]
    assert [t.token_id for t in sample(logits, rows)] == expected
    assert expected != logits.argmax(-1).tolist()  # the penalties did move some


def test_sampled_rows_draw_from_the_penalized_distribution_at_their_temperature():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 1.5, 0.2, -1.0])
    history = {
        "output": (4, 4, 5),
        "prompt": (0, 1),
        "presence_penalty": 0.3,
        "frequency_penalty": 0.2,
        "repetition_penalty": 1.5,
    }
    r = row(temperature=0.8, **history)
    expected = torch.tensor(reference(logits.tolist(), r), dtype=torch.float64).div(0.8).softmax(-1)
    tokens = drawn(logits, 20_000, temperature=0.8, **history)
    assert chi_square(tokens, expected) < CHI2_7_DOF


# --- logit_bias and its order with the mask ---------------------------------------------------------


def test_a_large_positive_bias_makes_a_token_the_greedy_pick_and_minus_100_bans_it():
    logits = random_logits(1, vocab=1000, scale=3.0, seed=13)[0]
    best, low = int(logits.argmax()), int(logits.argmin())
    (token,) = sample(logits[None], [row(temperature=0.0, logit_bias=((low, 100.0),))])
    assert token.token_id == low
    probs = torch.zeros(1000)
    probs[best], probs[low] = 0.6, 0.4  # two likely tokens
    banned = drawn(probs.log(), 2000, logit_bias=((best, -100.0),))
    assert set(banned) == {low}
    assert sample(probs.log()[None], [row(temperature=0.0, logit_bias=((best, -100.0),))])[0].token_id == low


def test_the_mask_wins_over_any_bias_or_penalty():
    logits = random_logits(1, vocab=1000, scale=0.5, seed=14)[0]
    logits[7] = 5.0
    push = {"logit_bias": ((7, 100.0),), "repetition_penalty": 0.5, "output": (7,)}  # both raise token 7
    masked = frozenset({7})
    assert process_logits(logits[None], [row(masked=masked, **push)])[0, 7] == -INF
    assert sample(logits[None], [row(temperature=0.0, masked=masked, **push)])[0].token_id != 7
    assert 7 not in drawn(logits, 500, masked=masked, **push)
    assert 7 not in drawn(logits, 500, masked=masked, top_k=3, **push)
    assert set(drawn(logits, 50, **push)) == {7}  # unmasked, it is all there is (so this can fail)


def test_allowed_token_ids_keep_greedy_picks_and_draws_to_themselves_with_their_own_law():
    logits = random_logits(1, vocab=1000, scale=3.0, seed=15)[0]
    allowed = frozenset(logits.argsort()[:3].tolist())  # the three least likely tokens
    (token,) = sample(logits[None], [row(temperature=0.0, allowed_token_ids=allowed, num_top_logprobs=0)])
    assert token.token_id == max(allowed, key=lambda t: logits[t])
    assert token.logprob == pytest.approx(float(logits.log_softmax(0)[token.token_id]))  # raw, as vLLM reports
    draws = drawn(logits, 3000, allowed_token_ids=allowed)
    assert set(draws) <= allowed
    restricted = torch.full_like(logits, -INF)
    restricted[list(allowed)] = logits[list(allowed)]
    assert drawn(restricted, 3000) == draws  # the same uniforms: the same tokens as from the masked logits
    assert set(drawn(logits, 200)) - allowed  # without it, other tokens come (so this can fail)


def test_bad_words_ban_their_last_token_where_the_output_ends_with_the_rest():
    words = ((7,), (1, 2), (3, 1, 2, 9), (4, 4))
    assert bad_word_bans(words, ()) == {7}  # a one-token word: always
    assert bad_word_bans(words, (5, 1)) == {7, 2}
    assert bad_word_bans(words, (3, 1, 2)) == {7, 9}  # (1, 2) is there already: only 9 completes a word
    assert bad_word_bans(words, (1, 2, 1)) == {7, 2}
    assert bad_word_bans(words, (4,)) == {7, 4}
    assert bad_word_bans(words, (1, 3)) == {7}


# --- min_p, top-p at a temperature ------------------------------------------------------------------


def test_min_p_keeps_tokens_at_least_min_p_times_as_likely_as_the_best():
    probs = torch.tensor([0.5, 0.3, 0.12, 0.05, 0.03])  # min_p 0.2: the bar is 0.1
    tokens = drawn(probs.log(), 20_000, min_p=0.2)
    kept = torch.tensor([0.5, 0.3, 0.12, 0.0, 0.0])
    assert chi_square(tokens, kept / kept.sum()) < 13.82  # 2 degrees of freedom, p = 0.001
    # at temperature 2 the probabilities flatten (as sqrt(p)): everything clears the bar
    assert set(drawn(probs.log(), 2000, min_p=0.2, temperature=2.0)) == {0, 1, 2, 3, 4}


def test_top_p_applies_to_the_distribution_at_the_rows_temperature():
    logits = torch.tensor([0.6, 0.25, 0.15]).log()  # top_p 0.7: at temperature 1 the nucleus is {0, 1}
    assert set(drawn(logits, 1000, top_p=0.7)) == {0, 1}
    assert set(drawn(logits, 1000, top_p=0.7, temperature=0.5)) == {0}  # p ~ (0.81, 0.14, 0.05)


def test_top_k_and_top_p_renormalize_what_they_keep():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0, 0.0, 0.0, 0.0]) + 1e-6
    kept = torch.tensor([0.4, 0.3, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert chi_square(drawn(probs.log(), 20_000, top_k=3), kept / kept.sum()) < 13.82
    assert chi_square(drawn(probs.log(), 20_000, top_p=0.8), kept / kept.sum()) < 13.82


def test_top_p_can_cut_inside_a_run_of_nearly_equal_tokens():
    # ten tokens of ~0.1 each (one histogram bucket): p = 0.35 keeps exactly the four best
    probs = torch.full((10,), 0.1) * (1 + 1e-4 * torch.arange(10, 0, -1))
    assert set(drawn(probs.log(), 6000, top_p=0.35)) == {0, 1, 2, 3}


@pytest.mark.parametrize(
    "params", [{"top_k": 4}, {"top_p": 0.42}, {"min_p": 0.2}, {"top_k": 4, "temperature": 0.7}], ids=str
)
def test_filters_are_exact_across_the_inverse_cdfs_cells(params):
    # four tokens spread over the three cells; half the mass on the rest, which every filter drops
    vocab, heavy = 3000, [0, 1500, 2999, 1024]
    probs = torch.full((vocab,), 0.5 / (vocab - len(heavy)), dtype=torch.float64)
    probs[heavy] = torch.tensor([0.2, 0.15, 0.1, 0.05], dtype=torch.float64)
    kept = heavy[:3] if "top_p" in params else heavy
    expected = torch.zeros(vocab, dtype=torch.float64)
    expected[kept] = probs[kept] ** (1 / params.get("temperature", 1.0))
    tokens = drawn(probs.float().log(), 20_000, **params)
    assert chi_square(tokens, expected / expected.sum()) < 16.27  # 3 degrees of freedom, p = 0.001


# --- batches, extremes --------------------------------------------------------------------------------


def test_a_penalized_seeded_row_draws_the_same_token_whatever_else_is_in_the_batch():
    logits = random_logits(1, vocab=3000, scale=1.0, seed=15)
    penalties = {"presence_penalty": 0.4, "frequency_penalty": 0.2, "repetition_penalty": 1.3}
    target = row(num_output_tokens=4, seed=3, output=(1, 2, 2, 9), prompt=(5, 6), logit_bias=((11, 1.5),), **penalties)
    alone = sample(logits, [target])[0].token_id
    others = [
        row(seed=1, output=(3, 3), frequency_penalty=1.0),
        row(temperature=0.0, output=(4,), repetition_penalty=2.0),
        row(seed=2, masked=frozenset({alone})),
        row(seed=4, top_p=0.5, presence_penalty=0.1, output=(alone,)),
        row(seed=5, min_p=0.1, draft=alone),
    ]
    for position in range(len(others) + 1):
        rows = others[:position] + [target] + others[position:]
        batch = torch.cat([random_logits(position, 3000, seed=16), logits, random_logits(5 - position, 3000, seed=17)])
        assert sample(batch, rows)[position].token_id == alone


def test_sampling_never_changes_the_callers_logits():
    logits = random_logits(4, vocab=3000, seed=18)
    before = logits.clone()
    sample(logits, [
        row(temperature=0.0, masked=frozenset({1}), logit_bias=((2, 3.0),)),
        row(seed=1, output=(5, 5), prompt=(6,), presence_penalty=1.0, frequency_penalty=1.0, repetition_penalty=2.0),
        row(seed=2, top_k=5, top_p=0.5, min_p=0.1, temperature=0.5),
        row(seed=3, draft=7, temperature=1.5),
    ])  # fmt: skip
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "params",
    [{"temperature": 1e30}, {"temperature": 1e-5, "top_p": 0.5}, {"repetition_penalty": 1e-30}, {"min_p": 1.0}],
    ids=["huge-temperature", "tiny-temperature-top-p", "huge-repetition-boost", "min-p-1"],
)
def test_extreme_values_still_give_a_real_token_and_a_finite_logprob(params):
    logits = random_logits(2, vocab=3000, scale=4.0, seed=19)
    rows = [row(seed=s, output=(1, 2), masked=frozenset({3}), num_top_logprobs=0, **params) for s in range(2)]
    for token in sample(logits, rows):
        assert 0 <= token.token_id < 3000 and token.token_id != 3 and math.isfinite(token.logprob)


def test_a_row_with_everything_masked_still_gets_a_token_and_a_finite_logprob():
    logits = random_logits(2, vocab=50, seed=20)
    everything = frozenset(range(50))
    rows = [row(temperature=0.0, masked=everything, num_top_logprobs=0), row(seed=1, masked=everything, num_top_logprobs=0)]
    for token in sample(logits, rows):
        assert 0 <= token.token_id < 50 and math.isfinite(token.logprob)


# --- prompt scoring -------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_rows,vocab", [(70, 1000), (3, 151936)])  # 70 rows: more than one scoring chunk
def test_score_tokens_is_the_raw_log_softmax_with_ranks_and_top_logprobs(num_rows, vocab):
    logits = random_logits(num_rows, vocab=vocab, scale=4.0, seed=21)
    targets = random_ids(num_rows, vocab, seed=22)
    expected = torch.log_softmax(logits.double(), dim=-1)
    scores = score_tokens(logits, targets, num_top=3)
    assert len(scores) == num_rows
    for i, (score, target) in enumerate(zip(scores, targets)):
        assert score.token_id == target
        assert score.logprob == pytest.approx(expected[i, target].item(), abs=1e-4)
        assert score.rank == 1 + int((expected[i] > expected[i, target]).sum())
        values, ids = torch.topk(expected[i], 3)
        assert [t for t, _ in score.top_logprobs] == ids.tolist()
        assert [lp for _, lp in score.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)


def test_score_tokens_ranks_ties_together_and_needs_no_top_logprobs():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0]])
    ranks = [score_tokens(logits, [t], num_top=0)[0] for t in range(4)]
    assert [s.rank for s in ranks] == [4, 1, 1, 3]
    assert all(s.top_logprobs == () for s in ranks)
    assert score_tokens(logits[:0], [], num_top=2) == []


def test_sampling_params_off_by_default():
    params = SamplingParams()
    assert not params.has_penalties and params.logit_bias == () and params.min_p == 0.0
    assert (
        SamplingParams(repetition_penalty=1.1).has_penalties
        and not SamplingParams(top_k=1, temperature=1.0).has_penalties
    )
    assert SamplingParams(top_k=1).greedy and SamplingParams(temperature=float("nan")).greedy
