"""The frontend's per-choice rules at unit level (docs/contract.md 1, 9-11, 16, 18), on the real
tokenizer; rule 18 on the real engine's outputs (the scripted double), one token a step or several."""

import pytest

from pegaserve.api.choice import ChoiceStream, StopStrings
from pegaserve.config import EngineConfig, SpeculativeConfig
from pegaserve.engine.offline import run_until_idle
from pegaserve.messages import EngineRequest, SampledToken, SamplingParams, StepOutput
from pegaserve.stop import Eos, Length, StopPolicy, String, Token
from pegaserve.testing.scripted import scripted_engine
from pegaserve.tokenizer import Tokenizer
from tests.contract.cases import EOS, HELLO, ONE_COMMA_TWO, WORLD


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


# --- rule 18 on real engine outputs: the trigger is released once, with its finish -------------------

PROMPT = (151644, 40000, 198, *ONE_COMMA_TWO, 198)  # holds " 1, 2": n-gram drafts reach the trigger
SPECULATIVE = EngineConfig(speculative=SpeculativeConfig(num_draft_tokens=4, prompt_lookup_min=1,
                                                          prompt_lookup_max=2))
STOP_17 = StopPolicy(8, eos_token_ids=frozenset({EOS}), stop_token_ids=frozenset({17}))
TRIGGERS = {  # name: (script, policy, the finish, the kept ids)
    "stop_id": (ONE_COMMA_TWO, STOP_17, Token(17), list(ONE_COMMA_TWO)),
    "eos": ((*ONE_COMMA_TWO[:4], EOS), STOP_17, Eos(EOS), [*ONE_COMMA_TWO[:4], EOS]),
    "length": (ONE_COMMA_TWO, StopPolicy(3, eos_token_ids=frozenset({EOS})), Length(), list(ONE_COMMA_TWO[:3])),
}


def engine_outputs(model_dir, generated, policy, config) -> list[StepOutput]:
    engine = scripted_engine(model_dir, {PROMPT: generated}, config)
    engine.add_request(EngineRequest("r", PROMPT, SamplingParams(temperature=0.0), policy))
    return run_until_idle(engine, 100)["r"]


@pytest.mark.parametrize("config", [EngineConfig(), SPECULATIVE], ids=["one_token_steps", "speculative_steps"])
@pytest.mark.parametrize("trigger", TRIGGERS)
def test_rule_18_the_trigger_is_released_once_with_its_finish(tokenizer, tiny_model_dir, trigger, config):
    generated, policy, finish, kept = TRIGGERS[trigger]
    outputs = engine_outputs(tiny_model_dir, generated, policy, config)
    assert outputs[-1].finish == finish and all(o.finish is None for o in outputs[:-1])  # decided in one message
    choice = stream(tokenizer)
    deltas = [d for d in (choice.feed(o) for o in outputs) if d is not None]
    released = [t.token_id for d in deltas for t in d.tokens]
    assert released == kept == choice.token_ids  # each token once, the trigger last
    assert deltas[-1].finish == finish and deltas[-1].tokens[-1].token_id == kept[-1]
    assert all(d.finish is None for d in deltas[:-1])
    if config.speculative is not None and trigger == "stop_id":
        assert len(outputs[-1].tokens) > 1  # the trigger arrived inside an accepted run


def test_rule_18_an_excluded_trigger_adds_no_text_but_is_released(tokenizer, tiny_model_dir):
    outputs = engine_outputs(tiny_model_dir, ONE_COMMA_TWO, STOP_17, SPECULATIVE)
    excluded, included = stream(tokenizer), stream(tokenizer, stops=["never"], include=True)
    texts = ["".join(d.text for d in (c.feed(o) for o in outputs) if d) for c in (excluded, included)]
    assert texts == [" 1, ", " 1, 2"]
    assert excluded.token_ids == included.token_ids == list(ONE_COMMA_TWO)


def test_stream_interval_recuts_outputs_and_never_holds_the_first_token_or_the_finish():
    from pegaserve.sched.stream_interval import StreamInterval

    outputs = [StepOutput("r", tokens(100 + i)) for i in range(6)] + [StepOutput("r", tokens(200), Length())]

    def delivered(n):
        interval = StreamInterval(n)
        messages = [m for m in (interval.push(o) for o in outputs) if m is not None] + interval.flush()
        return [[t.token_id for t in m.tokens] for m in messages]

    assert delivered(1) == [[100], [101], [102], [103], [104], [105], [200]]
    assert delivered(4) == [[100], [101, 102, 103, 104], [105, 200]]  # the first token at once
    assert delivered(100)[-1][-1] == 200  # the finish never waits
    interval = StreamInterval(4)
    assert interval.push(outputs[0]) is not None and interval.push(outputs[1]) is None
    assert [[t.token_id for t in m.tokens] for m in interval.flush()] == [[101]]  # held, released on demand