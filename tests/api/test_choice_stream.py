"""The ingress's per-choice rules at unit level (docs/CONTRACT.md 1, 9-11, 16, 18), on the real tokenizer."""

import pytest

from pegaserve.api.choice import ChoiceStream, StopStrings
from pegaserve.engine.request import SampledToken, StepOutput
from pegaserve.stop import Eos, Length, String, Token
from pegaserve.tokenizer import Tokenizer
from tests.contract.cases import EOS, HELLO, WORLD


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return Tokenizer(tiny_model_dir)


def tokens(*ids: int) -> tuple[SampledToken, ...]:
    return tuple(SampledToken(i, -0.1 * (n + 1)) for n, i in enumerate(ids))


def stream(tokenizer, stops=(), include=False, min_tokens=0) -> ChoiceStream:
    return ChoiceStream(tokenizer.detokenizer(), StopStrings(tuple(stops), include), min_tokens)


def test_rule_11_tokens_after_a_string_match_in_the_same_message_are_discarded(tokenizer):
    choice = stream(tokenizer, stops=["lo"])
    delta = choice.feed(StepOutput("r", tokens(HELLO, WORLD, EOS)))  # a multi-token message
    assert delta.text == "Hel" and [t.token_id for t in delta.tokens] == [HELLO]
    assert delta.finish == String("lo") and choice.token_ids == [HELLO]


def test_rule_1_nothing_after_the_terminal_token(tokenizer):
    choice = stream(tokenizer)
    delta = choice.feed(StepOutput("r", tokens(HELLO, EOS), Eos(EOS)))
    assert choice.token_ids == [HELLO, EOS] and delta.finish == Eos(EOS)
    with pytest.raises(AssertionError):
        choice.feed(StepOutput("r", tokens(WORLD)))


def test_rule_9_a_multi_token_step_equals_token_by_token(tokenizer):
    stops = ["world", "o w"]
    together = stream(tokenizer, stops).feed(StepOutput("r", tokens(HELLO, WORLD)))
    one_by_one = stream(tokenizer, stops)
    first = one_by_one.feed(StepOutput("r", tokens(HELLO)))
    second = one_by_one.feed(StepOutput("r", tokens(WORLD)))
    assert (first.text if first else "") + second.text == together.text == "Hell"
    assert second.finish == together.finish == String("o w")


def test_rule_16_holdback_is_only_the_prefix_of_a_stop_string(tokenizer):
    choice = stream(tokenizer, stops=[" world!"])
    assert choice.feed(StepOutput("r", tokens(HELLO))).text == "Hello"
    assert choice.feed(StepOutput("r", tokens(WORLD))) is None  # " world" held: it may become " world!"
    delta = choice.feed(StepOutput("r", tokens(EOS), Eos(EOS)))
    assert delta.text == " world" and delta.finish == Eos(EOS)  # released at the end
    assert [t.token_id for t in delta.tokens] == [WORLD, EOS]  # ids travel with their text


def test_rule_16_nothing_is_held_when_the_stop_string_is_included(tokenizer):
    choice = stream(tokenizer, stops=[" world!"], include=True)
    choice.feed(StepOutput("r", tokens(HELLO)))
    assert choice.feed(StepOutput("r", tokens(WORLD))).text == " world"


def test_rule_18_a_pending_decision_holds_the_token_until_it_arrives(tokenizer):
    choice = stream(tokenizer)
    assert choice.feed(StepOutput("r", tokens(HELLO, 17), finish_pending=True)).text == "Hello"
    delta = choice.feed(StepOutput("r", (), Token(17)))
    assert [t.token_id for t in delta.tokens] == [17] and delta.finish == Token(17) and delta.text == ""
    assert choice.token_ids == [HELLO, 17]


def test_rule_18_a_pending_token_that_turns_out_ordinary_is_shown_once(tokenizer):
    choice = stream(tokenizer)
    first = choice.feed(StepOutput("r", tokens(HELLO), finish_pending=True))
    assert first is None
    delta = choice.feed(StepOutput("r", tokens(WORLD), Length()))
    assert delta.text == "Hello world" and choice.token_ids == [HELLO, WORLD]


def test_in_chunks_recuts_outputs_and_never_holds_the_finish():
    import asyncio

    from pegaserve.engine.async_engine import in_chunks

    async def outputs():
        for i in range(5):
            yield StepOutput("r", tokens(100 + i))
        yield StepOutput("r", tokens(200), Length())

    async def collect(n):
        return [[t.token_id for t in o.tokens] for o in [o async for o in in_chunks(outputs(), n)]]

    assert asyncio.run(collect(1)) == [[100], [101], [102], [103], [104], [200]]
    assert asyncio.run(collect(4)) == [[100, 101, 102, 103], [104, 200]]
