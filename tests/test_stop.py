"""docs/contract.md token-level rules 1-7, one test each, on the policy and the engine's request."""

from pegaserve.messages import EngineRequest, SampledToken, SamplingParams
from pegaserve.request import RequestState
from pegaserve.stop import Eos, Length, StopPolicy, Token, finish_reason, stop_reason

EOS = 151645


def policy(**kw) -> StopPolicy:
    return StopPolicy(**{"max_tokens": 16, "eos_token_ids": frozenset({EOS, 151643}), **kw})


def run(tokens: list[int], p: StopPolicy) -> tuple[list[int], object]:
    request = RequestState(EngineRequest("r", (1, 2, 3), SamplingParams(), p))
    for token_id in tokens:
        cause = request.append(SampledToken(token_id, -0.5), max_model_len=4096)
        if cause is not None:
            return [t.token_id for t in request.output], cause
    return [t.token_id for t in request.output], None


def test_rule1_first_terminal_token_ends_the_request():
    kept, cause = run([220, 16, 17, 99, 100], policy(stop_token_ids=frozenset({17})))
    assert kept == [220, 16, 17] and cause == Token(17)


def test_rule2_order_min_tokens_then_eos_then_stop_ids_then_length():
    p = policy(max_tokens=3, min_tokens=1, stop_token_ids=frozenset({EOS, 17}))
    assert p.classify(EOS, 1) is None  # gate closed (the id was masked anyway)
    assert p.classify(EOS, 2) == Eos(EOS)  # eos before stop ids
    assert p.classify(17, 3) == Token(17)  # stop ids before length
    assert p.classify(5, 3) == Length()


def test_rule3_ignore_eos_disables_only_model_eos():
    p = policy(ignore_eos=True, stop_token_ids=frozenset({17}))
    assert p.classify(EOS, 1) is None
    assert p.classify(17, 1) == Token(17)


def test_rule4_eos_that_is_also_a_stop_id():
    assert policy(stop_token_ids=frozenset({EOS})).classify(EOS, 2) == Eos(EOS)
    assert policy(stop_token_ids=frozenset({EOS}), ignore_eos=True).classify(EOS, 2) == Token(EOS)


def test_rule5_stop_on_the_max_tokens_th_token_is_a_stop():
    kept, cause = run([1, 2, 17], policy(max_tokens=3, stop_token_ids=frozenset({17})))
    assert cause == Token(17) and finish_reason(cause) == "stop" and stop_reason(cause) == 17
    kept, cause = run([1, 2, 3], policy(max_tokens=3))
    assert cause == Length() and finish_reason(cause) == "length" and stop_reason(cause) is None


def test_rule6_min_tokens_masks_eos_and_stop_ids_until_k_tokens_exist():
    p = policy(min_tokens=3, stop_token_ids=frozenset({17}))
    assert p.masked_token_ids(0) == p.masked_token_ids(2) == frozenset({EOS, 151643, 17})
    assert p.masked_token_ids(3) == frozenset()
    assert policy(min_tokens=2, ignore_eos=True).masked_token_ids(0) == frozenset()
    kept, cause = run([5, 6, 7, EOS], p)
    assert kept == [5, 6, 7, EOS] and cause == Eos(EOS)


def test_rule7_trigger_token_is_kept_with_its_logprob():
    request = RequestState(EngineRequest("r", (1,), SamplingParams(), policy(stop_token_ids=frozenset({17}))))
    request.append(SampledToken(16, -0.1), 4096)
    request.append(SampledToken(17, -2.5), 4096)
    assert [t.token_id for t in request.output] == [16, 17]
    assert request.output[-1].logprob == -2.5


def test_full_context_is_length():
    request = RequestState(EngineRequest("r", (1, 2), SamplingParams(), policy(max_tokens=10)))
    assert request.append(SampledToken(5, 0.0), max_model_len=3) == Length()
