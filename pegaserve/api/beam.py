"""Beam search (vLLM's `use_beam_search`, `n` beams wide, with its `length_penalty`), run by the
frontend over any engine the way vLLM's server runs it.

Each step asks the engine for one token of every live beam, with the `2 * n` best alternatives
(logprobs are the raw log-softmax, as everywhere: sampling parameters play no part), and ranks
all the continuations by cumulative logprob. A continuation that ends — model EOS unless
`ignore_eos`, a `stop_token_ids` id, or, among those ranked high enough to stay, a stop string —
joins the finished beams; the `n` best of the others are the next step's live beams. After
`max_tokens` steps the live beams finish by length. The choices are the `n` finished beams with
the best score, cum_logprob / length ** length_penalty, where the length counts the prompt and
the output less an EOS that ended it (vLLM's and transformers' score), best first.

A choice's tokens run through its trigger, and its text is what a `ChoiceStream` makes of them,
as for any other choice (docs/contract.md, rules 7-14); every choice comes out whole, at the end.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from pegaserve.api.choice import ChoiceStream
from pegaserve.messages import SampledToken, StepOutput
from pegaserve.stop import Eos, StopCause, StopPolicy, String, Token


@dataclass(frozen=True)
class BeamPlan:
    width: int  # the request's n
    length_penalty: float = 1.0


@dataclass(frozen=True)
class Beam:
    tokens: tuple[SampledToken, ...] = ()  # the output so far, each token with its logprob
    cum_logprob: float = 0.0
    finish: StopCause | None = None  # Eos, Token, String or Length once it finished

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(t.token_id for t in self.tokens)

    def score(self, num_prompt_tokens: int, length_penalty: float) -> float:
        length = num_prompt_tokens + len(self.tokens) - isinstance(self.finish, Eos)
        return self.cum_logprob / max(length, 1) ** length_penalty


# One step: the engine's next token of each context (prompt + a beam's output), whose
# `top_logprobs` hold the alternatives the step asked for, best first.
Step = Callable[[list[tuple[int, ...]]], Awaitable[Sequence[SampledToken]]]


def num_alternatives(plan: BeamPlan, num_top_logprobs: int | None) -> int:
    """How many alternatives a step asks the engine for: the search's, and the client's logprobs."""
    return max(2 * plan.width, num_top_logprobs or 0)


async def beam_search(step: Step, prompt: tuple[int, ...], policy: StopPolicy, plan: BeamPlan,
                      num_top_logprobs: int | None, new_stream: Callable[[], ChoiceStream] | None) -> list[Beam]:
    """The request's `plan.width` choices, best first. `new_stream` makes a fresh ChoiceStream of the
    request's (its stop strings): None when it has none."""
    live, finished = [Beam()], []
    for _ in range(policy.max_tokens):
        sampled = await step([prompt + beam.token_ids for beam in live])
        ranked = sorted(((beam.cum_logprob + logprob, beam, token_id, logprob, next_token.top_logprobs)
                         for beam, next_token in zip(live, sampled)
                         for token_id, logprob in next_token.top_logprobs[:2 * plan.width]),
                        key=lambda candidate: -candidate[0])
        live = []
        for cum_logprob, parent, token_id, logprob, top in ranked:
            shown = top[:num_top_logprobs] if num_top_logprobs else ()
            tokens = parent.tokens + (SampledToken(token_id, logprob, shown),)
            cause = policy.classify(token_id, len(tokens))
            if isinstance(cause, Eos | Token):
                finished.append(Beam(tokens, cum_logprob, cause))
            elif len(live) < plan.width:
                text_stop = _stop_string(new_stream, tokens)
                if text_stop is not None:
                    finished.append(Beam(tokens, cum_logprob, text_stop))
                else:
                    live.append(Beam(tokens, cum_logprob, cause))  # cause: Length on the last step
        if not live:
            break
    beams = finished + live
    beams.sort(key=lambda beam: beam.score(len(prompt), plan.length_penalty), reverse=True)
    return beams[: plan.width]


def _stop_string(new_stream: Callable[[], ChoiceStream] | None, tokens: tuple[SampledToken, ...]) -> String | None:
    """The stop string the output's last token completes, if any, as a ChoiceStream finds it."""
    if new_stream is None:
        return None
    stream = new_stream()
    stream.feed(StepOutput("", tokens))
    return stream.finish if isinstance(stream.finish, String) else None


def final_output(choice_id: str, beam: Beam, first_step: StepOutput) -> StepOutput:
    """A finished beam as the one engine message its choice's ChoiceStream takes (a stop string
    the stream finds again itself), with the prompt's logprobs and cached tokens from `first_step`."""
    finish = None if isinstance(beam.finish, String) else beam.finish
    return StepOutput(choice_id, beam.tokens, finish, first_step.prompt_logprobs,
                      num_cached_tokens=first_step.num_cached_tokens)
