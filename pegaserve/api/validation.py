"""From a validated body to engine requests: every docs/CONTRACT.md validation rule lives here, so bad
input never reaches an engine."""

from __future__ import annotations

from dataclasses import dataclass

from pegaserve.api.choice import StopStrings
from pegaserve.api.errors import ApiError, invalid
from pegaserve.api.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from pegaserve.engine.request import SamplingParams
from pegaserve.stop import StopPolicy

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class Limits:
    """Configurable request limits (sane defaults; the whole-vocabulary stop set must still fit)."""

    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 262_144
    max_logprobs: int = MAX_LOGPROBS
    max_body_bytes: int = 4 * 1024 * 1024  # a whole-vocabulary stop_token_ids list is about 1 MB
    max_prompt_tokens: int | None = None  # None: only the context length limits the prompt
    max_tokens: int | None = None  # a cap on max_tokens; None: only the context limits it


@dataclass(frozen=True)
class ModelInfo:
    """What validation needs to know about the served model."""

    name: str
    root: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]


@dataclass(frozen=True)
class ChoicePlan:
    """Everything needed to run one choice: engine-side parameters and ingress-side obligations."""

    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    policy: StopPolicy
    stops: StopStrings
    skip_special_tokens: bool


def check_model(body: SamplingFields, model: ModelInfo) -> None:
    if body.model is not None and body.model not in (model.name, model.root):
        raise ApiError(f"The model `{body.model}` does not exist.", param="model", status=404)


def check_unsupported(body: SamplingFields) -> None:
    if body.n != 1:
        raise invalid("n", "only n=1 is supported")
    if body.presence_penalty != 0.0 or body.frequency_penalty != 0.0 or body.repetition_penalty != 1.0:
        param = "presence_penalty" if body.presence_penalty else (
            "frequency_penalty" if body.frequency_penalty else "repetition_penalty")
        raise invalid(param, "penalties are not supported")
    if body.logit_bias:
        raise invalid("logit_bias", "logit_bias is not supported")
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options", "stream_options is only allowed when stream is true")


def check_prompt_ids(ids: list[int], model: ModelInfo, param: str, limits: Limits) -> tuple[int, ...]:
    if not ids:
        raise invalid(param, "the prompt is empty")
    if limits.max_prompt_tokens is not None and len(ids) > limits.max_prompt_tokens:
        raise invalid(param, f"the prompt has {len(ids)} tokens; this server accepts at most {limits.max_prompt_tokens}")
    bad = next((i for i in ids if not 0 <= i < model.vocab_size), None)
    if bad is not None:
        raise invalid(param, f"token id {bad} is outside the vocabulary [0, {model.vocab_size})")
    if len(ids) >= model.max_model_len:
        raise invalid(param, f"the prompt has {len(ids)} tokens; it alone fills the context of {model.max_model_len}")
    return tuple(ids)


def plan_choice(
    body: SamplingFields,
    prompt_ids: tuple[int, ...],
    model: ModelInfo,
    limits: Limits,
    max_tokens: int | None,
    num_top_logprobs: int,
    max_tokens_param: str = "max_tokens",
) -> ChoicePlan:
    room = model.max_model_len - len(prompt_ids)
    if max_tokens is None:
        max_tokens = room if limits.max_tokens is None else min(room, limits.max_tokens)
    if max_tokens < 1:
        raise invalid(max_tokens_param, f"must be at least 1, got {max_tokens}")
    if limits.max_tokens is not None and max_tokens > limits.max_tokens:
        raise invalid(max_tokens_param, f"this server generates at most {limits.max_tokens} tokens, got {max_tokens}")
    if max_tokens > room:
        raise invalid(
            max_tokens_param,
            f"{max_tokens} tokens requested but the context of {model.max_model_len} leaves {room} "
            f"after the prompt's {len(prompt_ids)} tokens",
        )
    if not 0 <= body.min_tokens <= max_tokens:
        raise invalid("min_tokens", f"must be between 0 and max_tokens ({max_tokens}), got {body.min_tokens}")
    stop_ids = _stop_token_ids(body, model, limits)
    if body.min_tokens > 0 and _masks_everything(stop_ids, body, model):
        raise invalid("min_tokens", "cannot be honoured: stop_token_ids (with EOS) cover the whole vocabulary")
    return ChoicePlan(
        prompt_token_ids=prompt_ids,
        sampling=_sampling(body, num_top_logprobs),
        policy=StopPolicy(
            max_tokens=max_tokens,
            eos_token_ids=model.eos_token_ids,
            stop_token_ids=stop_ids,
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
        ),
        stops=StopStrings(_stop_strings(body, limits), body.include_stop_str_in_output),
        skip_special_tokens=body.skip_special_tokens,
    )


def _sampling(body: SamplingFields, num_top_logprobs: int) -> SamplingParams:
    if not 0.0 <= body.temperature <= 2.0:
        raise invalid("temperature", f"must be in [0, 2], got {body.temperature}")
    if not 0.0 < body.top_p <= 1.0:
        raise invalid("top_p", f"must be in (0, 1], got {body.top_p}")
    if body.top_k < -1:
        raise invalid("top_k", f"must be -1 (disabled), 0 (disabled) or positive, got {body.top_k}")
    return SamplingParams(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=max(body.top_k, 0),
        seed=body.seed,
        num_top_logprobs=num_top_logprobs,
    )


def _stop_strings(body: SamplingFields, limits: Limits) -> tuple[str, ...]:
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > limits.max_stop_strings:
        raise invalid("stop", f"at most {limits.max_stop_strings} stop strings, got {len(stops)}")
    for s in stops:
        if not s:
            raise invalid("stop", "stop strings must not be empty")
        if len(s) > limits.max_stop_string_chars:
            raise invalid("stop", f"stop strings are limited to {limits.max_stop_string_chars} characters")
    return tuple(dict.fromkeys(stops))


def _stop_token_ids(body: SamplingFields, model: ModelInfo, limits: Limits) -> frozenset[int]:
    ids = body.stop_token_ids or []
    if len(ids) > limits.max_stop_token_ids:
        raise invalid("stop_token_ids", f"at most {limits.max_stop_token_ids} ids, got {len(ids)}")
    bad = next((i for i in ids if not 0 <= i < model.vocab_size), None)
    if bad is not None:
        raise invalid("stop_token_ids", f"token id {bad} is outside the vocabulary [0, {model.vocab_size})")
    return frozenset(ids)


def _masks_everything(stop_ids: frozenset[int], body: SamplingFields, model: ModelInfo) -> bool:
    masked = stop_ids if body.ignore_eos else stop_ids | model.eos_token_ids
    return len(masked) >= model.vocab_size


def completion_logprobs(body: CompletionRequest, limits: Limits) -> int:
    if body.logprobs is None:
        return 0
    if not 0 <= body.logprobs <= limits.max_logprobs:
        raise invalid("logprobs", f"must be between 0 and {limits.max_logprobs}, got {body.logprobs}")
    return body.logprobs


def chat_logprobs(body: ChatCompletionRequest, limits: Limits) -> int:
    if body.top_logprobs is None:
        return 0
    if not body.logprobs:
        raise invalid("top_logprobs", "requires logprobs to be true")
    if not 0 <= body.top_logprobs <= limits.max_logprobs:
        raise invalid("top_logprobs", f"must be between 0 and {limits.max_logprobs}, got {body.top_logprobs}")
    return body.top_logprobs


def check_completion_only(body: CompletionRequest) -> None:
    if body.echo:
        raise invalid("echo", "echo is not supported")
    if body.suffix:
        raise invalid("suffix", "suffix is not supported")
    if body.best_of not in (None, 1):
        raise invalid("best_of", "only best_of=1 is supported")
