"""From a parsed body to what the engine runs: every docs/contract.md validation rule, and every
parameter's range, lives here, so bad input never reaches an engine. Each refusal is a 400 naming
the parameter."""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass, replace

from pegaserve.api.beam import BeamPlan
from pegaserve.api.choice import StopStrings
from pegaserve.api.errors import ApiError, invalid
from pegaserve.api.model_info import ModelInfo
from pegaserve.api.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from pegaserve.config import Limits
from pegaserve.messages import SamplingParams
from pegaserve.sample.grammar import GrammarSpec
from pegaserve.stop import StopPolicy

GREEDY_BELOW = 1e-5  # vLLM's threshold: a smaller temperature is greedy
# fp32 logits divided by a smaller penalty overflow to inf; any penalty this small already makes
# every repeated token with a positive logit win, so smaller ones act as this one.
MIN_REPETITION_PENALTY = 1e-6
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on each bias
INT64 = (-(2**63), 2**63 - 1)


@dataclass(frozen=True)
class PromptPlan:
    """One prompt of a request: what its engine request carries (`n` choices share it) and what
    the frontend owes each of its choices."""

    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    policy: StopPolicy
    stops: StopStrings
    skip_special_tokens: bool
    num_prompt_logprobs: int | None  # None: the engine does not score the prompt
    echo_text: str = ""  # shown before each choice's text (echo)
    cache_salt: str | None = None  # EngineRequest.cache_salt
    priority: int = 0  # EngineRequest.priority
    prediction: tuple[int, ...] = ()  # EngineRequest.prediction


def check_vocabulary(param: str, ids, vocab_size: int) -> None:
    """Every id in `ids` is a token of the vocabulary; else a 400 naming `param` and the first that is not."""
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise invalid(param, f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def check_model(model: str | None, info: ModelInfo) -> None:
    if model is not None and model not in (info.name, info.root):
        raise ApiError(f"The model `{model}` does not exist.", param="model", status=404)


def check_refused(body: SamplingFields, names: tuple[str, ...], why: str = "is not supported") -> None:
    """Fields pegaserve knows but does not serve (here, or with what else the body asks for):
    accepted at their defaults (or an empty list, e.g. `tools: []`) only."""
    for name in names:
        value, default = getattr(body, name), type(body).model_fields[name].default
        if value != default and value != [] and value != "":
            raise invalid(name, f"{why} (only {default!r})")


# What beam search has no use for: it ranks beams by the model's raw logprobs, and takes no mask
_NOT_WITH_BEAMS = ("top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                   "allowed_token_ids", "bad_words", "min_tokens", "prompt_logprobs", "logprob_token_ids")


def beam_search(body: SamplingFields, grammar: GrammarSpec | None) -> BeamPlan | None:
    """vLLM's `use_beam_search`: `n` beams (pegaserve/api/beam.py). What would change the model's
    distribution is a 400 beside it, never ignored."""
    if not body.use_beam_search:
        if body.length_penalty != 1.0:
            raise invalid("length_penalty", "only applies with use_beam_search")
        return None
    check_refused(body, _NOT_WITH_BEAMS, "is not available with use_beam_search")
    if "temperature" in body.model_fields_set and body.temperature >= GREEDY_BELOW:
        raise invalid("temperature", "beam search ranks beams by the model's own logprobs: send 0 or leave it out")
    if body.top_k not in (0, -1):
        raise invalid("top_k", "is not available with use_beam_search (only 0 or -1)")
    if grammar is not None:
        raise invalid("use_beam_search", "not with a structured output or a tool_choice that needs a grammar")
    return BeamPlan(body.n, body.length_penalty)


def check_common(body: SamplingFields, num_prompts: int, limits: Limits) -> None:
    """What holds for the whole request, before any prompt is looked at."""
    if body.stream_options is not None:
        if not body.stream:
            raise invalid("stream_options", "stream_options is only allowed when stream is true")
        if body.stream_options.continuous_usage_stats and not body.stream_options.include_usage:
            raise invalid("stream_options", "continuous_usage_stats needs include_usage")
    if body.n < 1:
        raise invalid("n", f"must be at least 1, got {body.n}")
    if body.n * num_prompts > limits.max_choices:
        raise invalid("n", f"{num_prompts} prompt(s) times n={body.n} is more than {limits.max_choices} choices")
    if body.seed is not None and not INT64[0] <= body.seed <= INT64[1]:
        raise invalid("seed", f"must be a 64-bit integer, got {body.seed}")
    if body.cache_salt == "":
        raise invalid("cache_salt", "must be a non-empty string if given")
    if body.priority != 0 and limits.scheduling_policy != "priority":
        raise invalid("priority", "priority scheduling is not enabled on this server (engine.scheduling_policy: "
                                  "priority enables it); only 0")
    if not INT64[0] <= body.priority <= INT64[1]:
        raise invalid("priority", f"must be a 64-bit integer, got {body.priority}")
    if body.prompt_logprobs is not None:
        if not 0 <= body.prompt_logprobs <= limits.max_logprobs:
            raise invalid("prompt_logprobs", f"must be between 0 and {limits.max_logprobs}, got {body.prompt_logprobs}")
        if body.stream:
            raise invalid("prompt_logprobs", "prompt_logprobs are not available when stream is true")
    if body.truncate_prompt_tokens is not None and body.truncate_prompt_tokens < 1 \
            and body.truncate_prompt_tokens != -1:
        raise invalid("truncate_prompt_tokens", f"must be -1 or at least 1, got {body.truncate_prompt_tokens}")


def check_completion(body: CompletionRequest, limits: Limits) -> int | None:
    """The completions-only fields; returns the logprobs' top-N (None: no logprobs)."""
    if body.best_of is not None and body.best_of != 1 and body.best_of != body.n:
        raise invalid("best_of", f"only best_of=1 or best_of=n (all choices returned) is supported, got {body.best_of}")
    if body.logprobs is not None and not 0 <= body.logprobs <= limits.max_logprobs:
        raise invalid("logprobs", f"must be between 0 and {limits.max_logprobs}, got {body.logprobs}")
    return body.logprobs


def check_chat(body: ChatCompletionRequest, limits: Limits) -> int | None:
    """The chat-only fields; returns the logprobs' top-N (None: no logprobs)."""
    if not body.messages:
        raise invalid("messages", "at least one message is required")
    if body.continue_final_message and body.add_generation_prompt:
        raise invalid("continue_final_message", "cannot be used with add_generation_prompt (set it to false)")
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise invalid("top_logprobs", "requires logprobs to be true")
        if not 0 <= body.top_logprobs <= limits.max_logprobs:
            raise invalid("top_logprobs", f"must be between 0 and {limits.max_logprobs}, got {body.top_logprobs}")
    return (body.top_logprobs or 0) if body.logprobs else None


MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's bound


def listed_logprobs(body: SamplingFields, model: ModelInfo, num_top: int | None,
                    echo: bool = False) -> tuple[int | None, tuple[int, ...] | None]:
    """vLLM's `logprob_token_ids`: each generated token's alternatives are these ids' logprobs, in
    their order, instead of the top-N. Returns the logprobs' count and the ids (None: the top-N)."""
    ids = body.logprob_token_ids
    if not ids:
        return num_top, None
    if num_top is None:
        raise invalid("logprob_token_ids", "needs logprobs (chat: logprobs true)")
    if num_top:
        raise invalid("logprob_token_ids", "lists the alternatives itself: not with a top-N (logprobs 0; chat: no "
                                           "top_logprobs)")
    if echo:
        raise invalid("logprob_token_ids", "not with echo (its prompt tokens show the top-N)")
    if len(ids) > MAX_LOGPROB_TOKEN_IDS:
        raise invalid("logprob_token_ids", f"at most {MAX_LOGPROB_TOKEN_IDS} ids, got {len(ids)}")
    check_vocabulary("logprob_token_ids", ids, model.vocab_size)
    listed = tuple(dict.fromkeys(ids))
    return len(listed), listed


def check_prompt_ids(ids: list[int], body: SamplingFields, model: ModelInfo, param: str,
                     limits: Limits) -> tuple[int, ...]:
    check_vocabulary(param, ids, model.vocab_size)
    if body.truncate_prompt_tokens is not None:
        keep = model.max_model_len if body.truncate_prompt_tokens == -1 else body.truncate_prompt_tokens
        ids = ids[-keep:] if body.truncation_side == "left" else ids[:keep]
    if not ids:
        raise invalid(param, "the prompt is empty")
    if limits.max_prompt_tokens is not None and len(ids) > limits.max_prompt_tokens:
        raise invalid(param, f"the prompt has {len(ids)} tokens; this server takes at most {limits.max_prompt_tokens}")
    if len(ids) >= model.max_model_len:
        raise invalid(param, f"the prompt has {len(ids)} tokens; it alone fills the context of {model.max_model_len}")
    return tuple(ids)


def plan_prompt(
    body: SamplingFields,
    prompt_ids: tuple[int, ...],
    model: ModelInfo,
    limits: Limits,
    max_tokens: tuple[int | None, str],
    num_top_logprobs: int | None,
    echo_text: str | None = None,
    bad_words: tuple[tuple[int, ...], ...] = (),
    grammar: GrammarSpec | None = None,
    logprob_token_ids: tuple[int, ...] | None = None,
) -> PromptPlan:
    """`max_tokens` is (value, the parameter that gave it); `echo_text` is None without echo, and
    with it `max_tokens=0` only scores the prompt; `bad_words` (`jobs.bad_words`) and `grammar`
    (`structured_output`) are the request's, found once for all its prompts."""
    policy = _policy(body, prompt_ids, model, limits, *max_tokens, echo=echo_text is not None)
    sampling = replace(_sampling(body, num_top_logprobs, model, limits, bad_words, grammar),
                       logprob_token_ids=logprob_token_ids)
    if sampling.allowed_token_ids is not None and sampling.allowed_token_ids <= policy.masked_token_ids(0):
        raise invalid("allowed_token_ids", "every allowed token is one that min_tokens holds back")
    num_prompt_logprobs = body.prompt_logprobs
    if echo_text is not None and num_top_logprobs is not None:  # echo shows the prompt's logprobs too
        num_prompt_logprobs = max(num_prompt_logprobs or 0, num_top_logprobs)
    return PromptPlan(
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        policy=policy,
        stops=StopStrings(_stop_strings(body, limits), body.include_stop_str_in_output),
        skip_special_tokens=body.skip_special_tokens,
        num_prompt_logprobs=num_prompt_logprobs,
        echo_text=echo_text or "",
        cache_salt=body.cache_salt,
        priority=body.priority,
    )


def _policy(body: SamplingFields, prompt_ids: tuple[int, ...], model: ModelInfo, limits: Limits,
            max_tokens: int | None, param: str, echo: bool) -> StopPolicy:
    room = model.max_model_len - len(prompt_ids)
    if max_tokens is None:
        max_tokens = room if limits.max_tokens is None else min(room, limits.max_tokens)
    if max_tokens < 1 and not (echo and max_tokens == 0):
        raise invalid(param, f"must be at least 1, got {max_tokens} (0 only scores the prompt: completions with echo)")
    if limits.max_tokens is not None and max_tokens > limits.max_tokens:
        raise invalid(param, f"this server generates at most {limits.max_tokens} tokens, got {max_tokens}")
    if max_tokens > room:
        raise invalid(param, f"{max_tokens} tokens requested but the context of {model.max_model_len} leaves {room} "
                             f"after the prompt's {len(prompt_ids)} tokens")
    if not 0 <= body.min_tokens <= max_tokens:
        raise invalid("min_tokens", f"must be between 0 and max_tokens ({max_tokens}), got {body.min_tokens}")
    stop_ids = _stop_token_ids(body, model, limits)
    masked = stop_ids if body.ignore_eos else stop_ids | model.eos_token_ids
    if body.min_tokens > 0 and len(masked) >= model.vocab_size:
        raise invalid("min_tokens", "cannot be honoured: stop_token_ids (with EOS) cover the whole vocabulary")
    return StopPolicy(max_tokens=max_tokens, eos_token_ids=model.eos_token_ids, stop_token_ids=stop_ids,
                      ignore_eos=body.ignore_eos, min_tokens=body.min_tokens)


def _sampling(body: SamplingFields, num_top_logprobs: int | None, model: ModelInfo, limits: Limits,
              bad_words: tuple[tuple[int, ...], ...], grammar: GrammarSpec | None) -> SamplingParams:
    _check_range("temperature", body.temperature, 0.0, 2.0)
    _check_range("top_p", body.top_p, 0.0, 1.0, open_low=True)
    _check_range("min_p", body.min_p, 0.0, 1.0)
    _check_range("presence_penalty", body.presence_penalty, -2.0, 2.0)
    _check_range("frequency_penalty", body.frequency_penalty, -2.0, 2.0)
    _check_range("repetition_penalty", body.repetition_penalty, 0.0, 2.0, open_low=True)
    if body.top_k < -1:
        raise invalid("top_k", f"must be -1 (disabled), 0 (disabled) or positive, got {body.top_k}")
    return SamplingParams(
        temperature=0.0 if body.temperature < GREEDY_BELOW else body.temperature,
        top_p=body.top_p,
        top_k=min(max(body.top_k, 0), model.vocab_size),
        # an unseeded request gets its seed here, so a resume on another replica draws exactly the
        # tokens the first one would have (the sampler is keyed by seed and position)
        seed=secrets.randbits(62) if body.seed is None else body.seed,
        num_top_logprobs=num_top_logprobs,
        min_p=body.min_p,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=1.0 if body.repetition_penalty == 1.0 else max(body.repetition_penalty,
                                                                           MIN_REPETITION_PENALTY),
        logit_bias=_logit_bias(body, model, limits),
        allowed_token_ids=_allowed_token_ids(body, model),
        bad_words=bad_words,
        grammar=grammar,
    )


def _check_range(param: str, value: float, low: float, high: float, open_low: bool = False) -> None:
    inside = math.isfinite(value) and (low < value if open_low else low <= value) and value <= high
    if not inside:
        raise invalid(param, f"must be in {'(' if open_low else '['}{low:g}, {high:g}], got {value!r}")


# vLLM's structured_outputs keys, and its older guided_* fields, by the kind of grammar they give
_STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "ebnf",
                     "json_object": "json_object"}
_GUIDED_KINDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "ebnf"}


def structured_output(body: SamplingFields, tool_grammar: GrammarSpec | None = None) -> GrammarSpec | None:
    """The grammar the output must match (pegaserve/sample/grammar.py), from whichever one field
    asks for one: response_format (json_object, json_schema), structured_outputs, a guided_* field,
    or tool_choice (`tool_grammar`: pegaserve/api/tools.py)."""
    asked: list[tuple[str, GrammarSpec]] = [] if tool_grammar is None else [("tool_choice", tool_grammar)]
    form = body.response_format
    if form is not None and form.type == "json_object":
        asked.append(("response_format", GrammarSpec("json_object")))
    elif form is not None and form.type == "json_schema":
        schema = (form.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise invalid("response_format", "json_schema needs a JSON schema object in json_schema.schema")
        asked.append(("response_format", GrammarSpec("json_schema", json.dumps(schema))))
    elif form is not None and form.type != "text":
        raise invalid("response_format", f"type must be 'text', 'json_object' or 'json_schema', got {form.type!r}")
    for name, kind in _GUIDED_KINDS.items():
        if getattr(body, name) is not None:
            asked.append((name, _grammar_spec(name, kind, getattr(body, name))))
    compact = False
    if body.structured_outputs is not None:
        if not isinstance(body.structured_outputs, dict):
            raise invalid("structured_outputs", "must be an object such as {\"json\": <schema>} or {\"regex\": ...}")
        compact = body.structured_outputs.get("disable_any_whitespace") is True
        for key, value in body.structured_outputs.items():
            if value is None or value is False or key == "disable_any_whitespace":
                continue
            if key not in _STRUCTURED_KINDS:
                raise invalid("structured_outputs", f"{key!r} is not supported (only {', '.join(_STRUCTURED_KINDS)})")
            asked.append(("structured_outputs", _grammar_spec("structured_outputs", _STRUCTURED_KINDS[key], value)))
    if not asked:
        return None
    if len(asked) > 1:
        raise invalid(asked[1][0], "only one structured output per request (response_format, structured_outputs, "
                                   "a guided_* field or a tool_choice that names or requires a tool), and only one "
                                   "kind of it")
    param, grammar = asked[0]
    if compact:  # vLLM's: JSON without whitespace of the model's choosing
        grammar = replace(grammar, any_whitespace=False)
    try:
        grammar.check()
    except ValueError as exc:
        raise invalid(param, f"cannot be used as a grammar: {exc}") from None
    if body.ignore_eos:
        raise invalid("ignore_eos", "must be false with a structured output: its grammar ends at EOS")
    if body.min_tokens:
        raise invalid("min_tokens", "must be 0 with a structured output: the grammar decides where it ends")
    return grammar


def _grammar_spec(param: str, kind: str, value) -> GrammarSpec:
    if kind == "json_object":
        if value is not True:
            raise invalid(param, "json_object must be true")
        return GrammarSpec(kind)
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise invalid(param, "the JSON schema is not valid JSON") from None
        if not isinstance(value, dict):
            raise invalid(param, "the JSON schema must be an object")
        return GrammarSpec(kind, json.dumps(value))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise invalid(param, "the choice must be a list of non-empty strings")
        return GrammarSpec(kind, json.dumps(value))
    if not isinstance(value, str) or not value:
        raise invalid(param, f"the {'regex' if kind == 'regex' else 'grammar'} must be a non-empty string")
    return GrammarSpec(kind, value)


def _allowed_token_ids(body: SamplingFields, model: ModelInfo) -> frozenset[int] | None:
    ids = body.allowed_token_ids
    if ids is None:
        return None
    if not ids:
        raise invalid("allowed_token_ids", "must hold at least one token id")
    check_vocabulary("allowed_token_ids", ids, model.vocab_size)
    return frozenset(ids)


def _logit_bias(body: SamplingFields, model: ModelInfo, limits: Limits) -> tuple[tuple[int, float], ...]:
    if not body.logit_bias:
        return ()
    if len(body.logit_bias) > limits.max_logit_bias:
        raise invalid("logit_bias", f"at most {limits.max_logit_bias} entries, got {len(body.logit_bias)}")
    biases: dict[int, float] = {}
    for key, bias in body.logit_bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise invalid("logit_bias", f"keys must be token ids, got {key!r}") from None
        check_vocabulary("logit_bias", (token_id,), model.vocab_size)
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise invalid("logit_bias", f"biases must be in [-100, 100], got {bias!r} for token {token_id}")
        biases[token_id] = float(bias)
    return tuple(sorted((t, b) for t, b in biases.items() if b != 0.0))


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
    check_vocabulary("stop_token_ids", ids, model.vocab_size)
    return frozenset(ids)
