"""The sampler: seeds, top-k/top-p, logprobs, greedy, min_tokens masking (docs/contract.md rule 6)
and speculative drafts. Processing (penalties, logit_bias, min_p) and prompt scoring are in
test_sampler_processing.py.

Function-level tests call `sample()` on hand-made logits; engine-level tests run the real engine,
with the tiny model (seeds) or a scripted one (masking), so batching and the runner are exercised.
The engine-level tests import the engine themselves, so the sampler's own tests run whatever
state the engine is in.
"""

import math
from dataclasses import replace

import pytest
import torch

from pegaserve.messages import SamplingParams
from pegaserve.sample.passes import argmax_rows, log_normalizers
from pegaserve.sample.processing import SamplingRow
from pegaserve.sample.sampler import sample

EOS = 151645
RUNNER_UP = 65  # the scripted model's runner-up token ("b")


def row(
    num_output_tokens: int = 0,
    masked: frozenset[int] = frozenset(),
    output: tuple[int, ...] = (),
    prompt: tuple[int, ...] = (),
    draft: int | None = None,
    **params,
) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), num_output_tokens, masked, output, prompt, draft)


def random_logits(num_rows: int, vocab: int = 1000, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def drawn(logits_row: torch.Tensor, num_draws: int, batch: int = 4096, **params) -> list[int]:
    """Sample the same logits once per seed 0..num_draws-1, `batch` rows at a time."""
    tokens = []
    for first in range(0, num_draws, batch):
        rows = [row(seed=seed, **params) for seed in range(first, min(first + batch, num_draws))]
        tokens += [t.token_id for t in sample(logits_row.expand(len(rows), -1).contiguous(), rows)]
    return tokens


def frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


def chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    """Pearson's statistic of the draws against `probs` (bins with no probability must stay empty)."""
    observed = torch.bincount(torch.tensor(tokens), minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    assert observed[expected == 0].sum() == 0, "drew a token with no probability"
    return float(((observed - expected)[expected > 0] ** 2 / expected[expected > 0]).sum())


# --- seeds --------------------------------------------------------------------------------------


def test_a_seeded_row_draws_the_same_token_whatever_else_is_in_the_batch():
    logits = random_logits(6)
    target = row(num_output_tokens=3, seed=7)
    alone = [sample(logits[i : i + 1], [target])[0].token_id for i in range(6)]
    others = [row(seed=1), row(temperature=0.0), row(seed=None), row(seed=9, top_k=50), row(seed=7, top_p=0.9)]
    for position in range(6):  # the target at every index of a batch of strangers
        rows = others[:position] + [target] + others[position:]
        batch_logits = torch.cat(
            [random_logits(position, seed=1), logits[position : position + 1], random_logits(5 - position, seed=2)]
        )
        assert sample(batch_logits, rows[:6])[position].token_id == alone[position]


def test_a_seeded_row_is_reproducible_and_its_draws_move_with_position():
    logits = random_logits(1, scale=0.0)  # uniform over 1000 tokens: any repeat would be chance
    first = [sample(logits, [row(num_output_tokens=p, seed=5)])[0].token_id for p in range(8)]
    again = [sample(logits, [row(num_output_tokens=p, seed=5)])[0].token_id for p in range(8)]
    assert first == again
    assert len(set(first)) >= 6  # positions get different noise, not the same draw eight times


def test_different_seeds_draw_different_tokens():
    tokens = drawn(random_logits(1, scale=0.0)[0], 40)
    assert len(set(tokens)) >= 30  # 40 uniform draws over 1000 tokens collide rarely


# --- top-k, top-p ---------------------------------------------------------------------------------


def test_top_k_draws_only_from_the_k_best_tokens():
    logits = random_logits(1, scale=0.3)[0]  # nearly flat: without top-k most draws land outside
    allowed = set(torch.topk(logits, 5).indices.tolist())
    tokens = drawn(logits, 300, top_k=5)
    assert set(tokens) <= allowed
    assert len(set(tokens)) >= 4  # it samples among them, not just the best


def test_top_k_over_a_full_vocabulary_keeps_the_k_best_and_ties_with_the_kth():
    logits = random_logits(1, vocab=151936, scale=0.1, seed=9)[0]
    best = [1024 * cell + 7 for cell in range(0, 140, 7)]  # 20 tokens, each in its own cell
    logits[best] = torch.arange(20, dtype=torch.float32).mul(-0.01).add(6.0)
    tie, near_miss = 150_000, 30_000  # another cell: the 20th value again, and just below it
    logits[tie], logits[near_miss] = logits[best[-1]], logits[best[-1]] - 1e-3
    tokens = drawn(logits, 256, batch=64, top_k=20, temperature=100.0)  # nearly uniform over the kept
    assert set(tokens) <= set(best) | {tie}
    assert tie in tokens and len(set(tokens)) >= 15


def test_top_p_draws_only_from_the_nucleus():
    # probabilities 0.5, 0.3, then 0.2 spread over 98 tokens: with top_p=0.75 the nucleus is {3, 8}
    probs = torch.full((100,), 0.2 / 98)
    probs[3], probs[8] = 0.5, 0.3
    tokens = drawn(probs.log(), 400, top_p=0.75)
    assert set(tokens) == {3, 8}
    # and without top-p the tail really is drawn (so the assertion above can fail)
    assert not set(drawn(probs.log(), 400)) <= {3, 8}


def test_top_p_keeps_the_best_token_even_when_it_alone_exceeds_p():
    probs = torch.full((50,), 0.1 / 49)
    probs[11] = 0.9
    assert set(drawn(probs.log(), 100, top_p=0.5)) == {11}


def test_top_k_and_top_p_combine():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1] + [0.0] * 4) + 1e-9
    # top-p applies to the top-k renormalized (4/9, 3/9, 2/9): the third token starts at 7/9 > 0.72;
    # over the raw probabilities it would start at 0.7 and be kept
    tokens = drawn(probs.log(), 300, top_k=3, top_p=0.72)
    assert set(tokens) == {0, 1}


# --- logprobs -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rows",
    [
        [row(temperature=0.0, num_top_logprobs=0)] * 4,  # an all-greedy batch, its tokens' logprobs alone
        [row(temperature=0.0, num_top_logprobs=5)] * 4,
        [
            row(temperature=0.0, num_top_logprobs=3),
            row(seed=1, temperature=0.7, num_top_logprobs=5),
            row(seed=2, top_k=20, top_p=0.8, num_top_logprobs=0),
            row(seed=3, temperature=1.3, masked=frozenset({0, 1, 2}), num_top_logprobs=1),
        ],
    ],
    ids=["greedy", "greedy-top-n", "mixed"],
)
def test_logprobs_are_the_log_softmax_of_the_raw_logits(rows):
    logits = random_logits(4, vocab=151936, scale=4.0, seed=3)
    expected = torch.log_softmax(logits.double(), dim=-1)
    for i, token in enumerate(sample(logits, rows)):
        assert token.logprob == pytest.approx(expected[i, token.token_id].item(), abs=1e-4)
        n = rows[i].params.num_top_logprobs or 0
        values, ids = torch.topk(expected[i], n)
        assert [t for t, _ in token.top_logprobs] == ids.tolist()
        assert [lp for _, lp in token.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)


def test_top_logprobs_find_the_best_tokens_in_any_cell_the_short_last_one_included():
    logits = random_logits(2, vocab=151936, scale=1.0, seed=7)
    logits[0, 151935], logits[0, 1023], logits[0, 1024] = 9.0, 8.0, 7.0  # the last token, a cell's edges
    logits[1, 151900] = logits[1, 5] = 8.0  # a tie, across cells
    expected = torch.log_softmax(logits.double(), dim=-1)
    first, second = sample(logits, [row(temperature=0.0, num_top_logprobs=4)] * 2)
    assert [t for t, _ in first.top_logprobs[:3]] == [151935, 1023, 1024]
    assert {t for t, _ in second.top_logprobs[:2]} == {5, 151900}
    for i, token in enumerate((first, second)):
        values, ids = torch.topk(expected[i], 4)
        assert {t for t, _ in token.top_logprobs} == set(ids.tolist())
        assert [lp for _, lp in token.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)


def test_listed_logprob_token_ids_replace_the_top_n_and_change_no_token():
    logits = random_logits(2, vocab=151936, scale=4.0, seed=5)
    expected = torch.log_softmax(logits.double(), dim=-1)
    listed = (151935, 7, 4096, 0)
    greedy, drawn = sample(logits, [row(temperature=0.0, num_top_logprobs=4, logprob_token_ids=listed),
                                    row(temperature=1.0, seed=9, num_top_logprobs=4, logprob_token_ids=listed)])
    for i, token in enumerate((greedy, drawn)):
        assert [t for t, _ in token.top_logprobs] == list(listed)  # in the order asked, not best first
        assert [lp for _, lp in token.top_logprobs] == pytest.approx(expected[i, list(listed)].tolist(), abs=1e-4)
    assert greedy.token_id == int(logits[0].argmax())
    (unlisted,) = sample(logits[1:].contiguous(), [row(temperature=1.0, seed=9, num_top_logprobs=4)])
    assert drawn.token_id == unlisted.token_id  # the same draw whichever alternatives are listed


def test_logprobs_hold_over_a_wide_logit_range():
    # the tiny model's logits span about -90..90; exp() of their differences overflows fp32
    logits = random_logits(4, vocab=151936, scale=40.0, seed=6)
    expected = torch.log_softmax(logits.double(), dim=-1)
    rows = [row(temperature=0.0)] * 2 + [row(seed=1), row(seed=2, top_p=0.5)]
    for i, token in enumerate(sample(logits, [replace(r, params=replace(r.params, num_top_logprobs=0)) for r in rows])):
        assert token.logprob == pytest.approx(expected[i, token.token_id].item(), abs=1e-4)


def test_logprob_of_a_masked_row_is_still_the_raw_one():
    logits = torch.zeros(1, 10)
    logits[0, 4], logits[0, 6] = 5.0, 3.0
    (token,) = sample(logits, [row(temperature=0.0, masked=frozenset({4}), num_top_logprobs=0)])
    assert token.token_id == 6
    assert token.logprob == pytest.approx(3.0 - math.log(math.exp(5.0) + math.exp(3.0) + 8), abs=1e-5)


def test_logprobs_not_asked_for_are_never_computed_and_change_no_token():
    logits = random_logits(8, vocab=151936, scale=4.0, seed=11)
    unasked = [  # no logprobs asked for: the default
        row(5, temperature=0.0),
        row(0, temperature=0.0),  # a choice's first token: none either (vLLM's way; the handoff carries None)
        row(5, seed=1),  # a plain temperature-1 draw finds the masses anyway, and reuses them
        row(5, seed=2, temperature=0.7),
        row(5, seed=3, top_p=0.8),
        row(5, temperature=0.0, masked=frozenset({0, 1})),
        row(5, seed=4, presence_penalty=0.5, output=(3, 4)),
    ]
    asked = [replace(r, params=replace(r.params, num_top_logprobs=0)) for r in unasked]
    top_two = row(5, temperature=0.0, num_top_logprobs=2)
    full, lean = sample(logits, [*asked, top_two]), sample(logits, [*unasked, top_two])
    assert [t.token_id for t in lean] == [t.token_id for t in full]
    assert [t.logprob for t in lean] == [None] * 7 + [full[7].logprob]
    assert all(t.logprob is not None for t in full)
    assert lean[7].top_logprobs == full[7].top_logprobs and all(t.top_logprobs == () for t in lean[:7])
    greedy_decode = sample(logits, [unasked[0]] * 8)  # the serving fast path: no masses at all
    assert [(t.token_id, t.logprob) for t in greedy_decode] == [(i, None) for i in argmax_rows(logits).tolist()]


# --- greedy -----------------------------------------------------------------------------------------


def test_greedy_is_the_argmax():
    logits = random_logits(8, vocab=151936, seed=4)
    expected = logits.argmax(-1).tolist()
    assert [t.token_id for t in sample(logits, [row(temperature=0.0)] * 8)] == expected
    # top_k=1 is greedy too, at any temperature and with any seed
    assert [t.token_id for t in sample(logits, [row(top_k=1, seed=s) for s in range(8)])] == expected


@pytest.mark.parametrize("temperature", [1e-9, 1e-30, 1e-45, 0.0, -0.0])
def test_tiny_temperatures_are_greedy_with_finite_logprobs(temperature):
    assert SamplingParams(temperature=temperature).greedy  # below vLLM's 1e-5
    logits = random_logits(4, vocab=151936, scale=4.0, seed=8)
    expected = torch.log_softmax(logits.double(), dim=-1)
    tokens = sample(logits, [row(temperature=temperature, seed=s, num_top_logprobs=2) for s in range(4)])
    assert [t.token_id for t in tokens] == logits.argmax(-1).tolist()
    for i, token in enumerate(tokens):
        assert math.isfinite(token.logprob)
        assert token.logprob == pytest.approx(expected[i, token.token_id].item(), abs=1e-4)
        assert all(math.isfinite(lp) for _, lp in token.top_logprobs)


def test_the_smallest_sampled_temperature_stays_finite():
    assert not SamplingParams(temperature=1e-5).greedy
    logits = random_logits(4, vocab=151936, scale=4.0, seed=8)  # best-to-second gaps >> 80 * 1e-5
    tokens = sample(logits, [row(temperature=1e-5, seed=s, num_top_logprobs=0) for s in range(4)])
    assert [t.token_id for t in tokens] == logits.argmax(-1).tolist()
    assert all(math.isfinite(t.logprob) for t in tokens)


@pytest.mark.parametrize("vocab", [151936, 50257, 8192, 1000])
def test_the_chunked_argmax_and_normalizer_agree_with_torch(vocab):
    logits = random_logits(6, vocab=vocab, scale=40.0, seed=5)  # a wide range: exp underflows
    logits[1, 5] = logits[1, vocab - 1] = 500.0  # a tie across chunks: the first one wins
    logits[2, vocab - 1] = 500.0  # the max in the last, short chunk
    logits[3] = float("-inf")  # everything masked
    logits[4, :] = 1.0  # all equal
    assert argmax_rows(logits).tolist() == logits.argmax(-1).tolist()
    expected = torch.logsumexp(logits.double(), -1).float()
    assert torch.allclose(log_normalizers(logits), expected, rtol=1e-6, atol=1e-5)


# --- min_tokens masking (rule 6) ----------------------------------------------------------------------


def test_masked_ids_are_never_sampled_even_when_they_are_the_argmax():
    logits = random_logits(1, scale=0.5)[0]
    logits[7], logits[9] = 30.0, 29.0  # together they hold nearly all the probability
    masked = frozenset({7, 9})
    (greedy,) = sample(logits[None], [row(temperature=0.0, masked=masked)])
    assert greedy.token_id == int(torch.topk(logits, 3).indices[2])
    tokens = [
        t.token_id
        for t in sample(logits.expand(200, -1).contiguous(), [row(seed=s, masked=masked) for s in range(200)])
    ]
    assert not set(tokens) & masked
    assert set(drawn(logits, 50)) & masked  # unmasked, they dominate (so the test can fail)


def test_masking_applies_per_row():
    logits = torch.zeros(2, 10)
    logits[:, 2] = 10.0
    tokens = sample(logits, [row(temperature=0.0, masked=frozenset({2})), row(temperature=0.0)])
    assert tokens[0].token_id != 2 and tokens[1].token_id == 2


# --- statistics shared by the draw tests here and in the sampler's other test modules ----------------
# Fixed seed sets, so each statistic is one number: the tests are deterministic, not flaky.

DRAFT_PROBS = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.05, 0.01])
NUM_DRAWS = 20_000
CHI2_7_DOF = 24.32  # chi-square with 7 degrees of freedom exceeds this with probability 0.001
CHI2_8_DOF = 26.12


# --- through the engine (which imports here, so that the tests above run in any state of it) ---------


def policy(max_tokens: int, **kw):
    from pegaserve.stop import StopPolicy
    from tests.helpers import EOS_IDS

    return StopPolicy(max_tokens, eos_token_ids=EOS_IDS, **kw)


def test_min_tokens_masks_eos_through_the_engine(tiny_model_dir):
    from pegaserve.config import EngineConfig
    from pegaserve.messages import EngineRequest
    from pegaserve.stop import Eos, Token
    from pegaserve.testing.scripted import scripted_engine
    from tests.helpers import run_to_completion, token_ids

    engine = scripted_engine(tiny_model_dir, {(7, 8, 9): [EOS] * 8, (5,): [17] * 8}, EngineConfig(num_blocks=32))
    engine.add_request(EngineRequest("eos", (7, 8, 9), SamplingParams(temperature=0.0), policy(8, min_tokens=3)))
    engine.add_request(
        EngineRequest(
            "stop", (5,), SamplingParams(temperature=0.0), policy(8, min_tokens=2, stop_token_ids=frozenset({17}))
        )
    )
    engine.add_request(EngineRequest("free", (7, 8, 9), SamplingParams(temperature=0.0), policy(8)))
    outputs = run_to_completion(engine)
    assert token_ids(outputs["eos"]) == [RUNNER_UP] * 3 + [EOS] and outputs["eos"][-1].finish == Eos(EOS)
    assert token_ids(outputs["stop"]) == [RUNNER_UP] * 2 + [17] and outputs["stop"][-1].finish == Token(17)
    assert token_ids(outputs["free"]) == [EOS]  # the same script, no gate: EOS at once


def test_min_tokens_masks_sampled_requests_through_the_engine(tiny_model_dir):
    from pegaserve.config import EngineConfig
    from pegaserve.messages import EngineRequest
    from pegaserve.testing.scripted import scripted_engine
    from tests.helpers import run_to_completion, token_ids

    # The scripted EOS holds ~85% of the probability at temperature 1; masked, it never appears.
    engine = scripted_engine(tiny_model_dir, {(7, 8, 9): [EOS] * 8}, EngineConfig(num_blocks=64))
    for seed in range(8):
        params = SamplingParams(temperature=1.0, seed=seed)
        engine.add_request(EngineRequest(f"gated{seed}", (7, 8, 9), params, policy(8, min_tokens=4)))
        engine.add_request(EngineRequest(f"open{seed}", (7, 8, 9), params, policy(8)))
    outputs = run_to_completion(engine)
    for seed in range(8):
        gated = token_ids(outputs[f"gated{seed}"])
        assert EOS not in gated[:4] and len(gated) >= 5
    assert sum(token_ids(outputs[f"open{seed}"])[0] == EOS for seed in range(8)) >= 4


def sampled(request_id: str, prompt: list[int], seed: int | None, **params):
    from pegaserve.messages import EngineRequest

    return EngineRequest(request_id, tuple(prompt), SamplingParams(seed=seed, **params), policy(16, ignore_eos=True))


def load_tiny_engine(tiny_model_dir, **config):
    from pegaserve.config import EngineConfig
    from pegaserve.engine.build import load_engine

    return load_engine(tiny_model_dir, EngineConfig(num_blocks=256, **config), attention_backend="sdpa")


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir):
    return load_tiny_engine(tiny_model_dir)


def run_requests(engine, requests) -> dict[str, list[int]]:
    from tests.helpers import run_to_completion, token_ids

    for request in requests:
        engine.add_request(request)
    return {rid: token_ids(outs) for rid, outs in run_to_completion(engine).items()}


def test_seeded_tokens_through_the_engine_do_not_depend_on_the_batch(tiny_model_dir, tiny_engine):
    from tests.helpers import PROMPTS, greedy_request

    target = PROMPTS[1]
    alone = run_requests(tiny_engine, [sampled("alone", target, seed=42)])["alone"]
    crowd = [sampled(f"c{i}", p, seed=100 + i) for i, p in enumerate(PROMPTS)]
    crowd += [greedy_request("g", PROMPTS[3], 16), sampled("unseeded", PROMPTS[5], seed=None, top_p=0.9)]
    batched = run_requests(tiny_engine, crowd[:4] + [sampled("mid", target, seed=42)] + crowd[4:])
    assert batched["mid"] == alone
    # joining late, into a running batch of two (so its prefill and decodes share other steps)
    small = load_tiny_engine(tiny_model_dir, max_num_seqs=2)
    late = run_requests(small, crowd[:3] + [sampled("late", target, seed=42)])
    assert late["late"] == alone
    greedy = run_requests(tiny_engine, [greedy_request("greedy", target, 16)])["greedy"]
    assert alone != greedy  # temperature 1 really sampled, so agreement above is the seed's doing


def test_different_seeds_give_different_tokens_through_the_engine(tiny_engine):
    from tests.helpers import PROMPTS

    tokens = run_requests(tiny_engine, [sampled(f"s{seed}", PROMPTS[1], seed=seed) for seed in range(4)])
    assert len({tuple(t) for t in tokens.values()}) == 4
