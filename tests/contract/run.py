"""Run a contract case through HTTP with the official openai client, streaming or not, and read the
answer with `pegaserve.testing.contract` — so both modes (and both deployments) compare equal."""

from __future__ import annotations

import dataclasses

import openai

from pegaserve.testing.contract import Answer, Expected, Params, answer_from_body, answer_from_chunks
from tests.contract.cases import CASES, CHAT_MESSAGES, Case

OPENAI_FIELDS = {"max_tokens", "stop", "logprobs", "top_logprobs", "seed", "temperature", "top_p",
                 "max_completion_tokens"}
INCLUDE_USAGE = {"include_usage": True}


def request_kwargs(case: Case, index: int, model: str) -> dict:
    params = {"temperature": 0.0, **case.params}
    if "max_tokens" not in params and "max_completion_tokens" not in params:
        params["max_tokens"] = 16
    kwargs = {k: v for k, v in params.items() if k in OPENAI_FIELDS}
    extra = {k: v for k, v in params.items() if k not in OPENAI_FIELDS}
    kwargs["model"] = model
    kwargs["extra_body"] = extra
    if case.chat:
        kwargs["messages"] = CHAT_MESSAGES(index)
    else:
        kwargs["prompt"] = list(case.prompt(index))
    return kwargs


def case_params(index: int, stream: bool) -> Params:
    """What the checks need of the request `ask` sends: the JSON body the openai client makes of it."""
    case = CASES[index]
    kwargs = request_kwargs(case, index, "unused")
    body = {**kwargs.pop("extra_body"), **kwargs, "stream": stream}
    if stream:
        body["stream_options"] = INCLUDE_USAGE
    params = Params.from_body(body, case.chat)
    return dataclasses.replace(params, num_choices=params.num_choices * case.params.get("n", 1))


def case_expected(index: int) -> Expected:
    """The case's outcome. The last kept token is the script's, unless min_tokens masked the
    script's choice (the model then takes its runner-up)."""
    case = CASES[index]
    last = None if case.params.get("min_tokens") else case.generated[case.completion_tokens - 1]
    return Expected(case.text, case.finish_reason, case.stop_reason, case.completion_tokens, last, case.rules)


def ask(client: openai.OpenAI, index: int, stream: bool, model: str = "qwen3-tiny") -> tuple[Answer, list]:
    """The case's answer (a stream's with its framing), and (streaming) the raw openai chunks."""
    case = CASES[index]
    kwargs = request_kwargs(case, index, model)
    create = client.chat.completions.create if case.chat else client.completions.create
    if not stream:
        return answer_from_body(create(**kwargs).model_dump(), case.chat), []
    chunks = list(create(stream=True, stream_options=INCLUDE_USAGE, **kwargs))
    return answer_from_chunks([chunk.model_dump() for chunk in chunks], case.chat), chunks
