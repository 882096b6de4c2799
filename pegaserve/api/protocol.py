"""OpenAI request bodies as pydantic models (strict: a string where an int belongs is a 400).

Every field is one of three kinds, and tests/api/test_fields.py holds each to its kind:
implemented (docs/api.md), accepted with no effect by definition (`user`, `metadata`,
`parallel_tool_calls` without tools...), or in `REFUSED`: accepted only at its default, otherwise a
400 naming it. An explicit `null` means the default for every field. A top-level field not
declared here is a 400 naming it, as OpenAI answers (`limits.refuse_unknown_fields: false` logs and
leaves it out instead, as vLLM does; api/body.py). Numbers must be finite (NaN and infinities are a 400).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, StrictBool, StrictInt, model_validator

StopField = str | list[str] | None
Role = Literal["system", "user", "assistant", "tool", "developer", "function"]  # function: OpenAI's legacy tool
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]  # OpenAI's


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        # Real clients send `"top_p": null` for "not set"; a required field left null is then
        # reported missing, naming it.
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class StreamOptions(Body):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # every chunk carries the usage so far (needs include_usage)


class ResponseFormat(Body):
    type: str  # "text", "json_object" or "json_schema"
    json_schema: dict[str, JsonValue] | None = None  # OpenAI's: {"name", "schema", "strict", "description"}


class SamplingKnobs(Body):
    """The sampling and stopping parameters every generating endpoint takes, the Responses API's
    too (as vLLM's extensions, beside its own fields)."""

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: StrictInt = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: StrictInt | None = None
    stop: StopField = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # no effect: an end-user label
    request_id: str | None = None  # the client's correlation id, like the X-Request-Id header
    cache_salt: str | None = None  # cached prompt blocks are shared only with requests of the same salt
    priority: StrictInt = 0  # vLLM's: lower runs first, under the priority scheduling policy only


class SamplingFields(SamplingKnobs):
    """The parameters both endpoints share (docs/contract.md, request parameters, and docs/api.md)."""

    max_tokens: StrictInt | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True  # no effect: byte-level tokens decode as they are
    return_token_ids: StrictBool = False
    return_tokens_as_token_ids: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    allowed_token_ids: list[StrictInt] | None = None  # vLLM's: sample only among these
    bad_words: list[str] | None = None  # vLLM's: words the output may not form
    # structured outputs (at most one of them, with response_format's json_object / json_schema):
    structured_outputs: JsonValue = None  # vLLM's: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    guided_json: JsonValue = None  # vLLM's older names of the same
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prompt_logprobs: StrictInt | None = None
    truncate_prompt_tokens: StrictInt | None = None
    truncation_side: Literal["left", "right"] = "left"
    response_format: ResponseFormat | None = None
    echo: StrictBool = False
    use_beam_search: StrictBool = False  # vLLM's: the choices are the n best beams (pegaserve/api/beam.py)
    length_penalty: float = 1.0  # beam search's: a beam's score is cum_logprob / length ** length_penalty
    logprob_token_ids: list[StrictInt] | None = None  # vLLM's: these ids' logprobs instead of the top-N
    # Refused unless at their defaults (`REFUSED`):
    kv_transfer_params: JsonValue = None
    vllm_xargs: JsonValue = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None  # only 1 or n
    add_special_tokens: StrictBool = True
    suffix: str | None = None  # refused unless empty


class ChatMessage(Body):
    role: Role
    content: str | list[dict[str, JsonValue]] | None = None  # text parts only
    name: str | None = None  # passed to the chat template, as the rest
    tool_calls: list[JsonValue] | None = None
    tool_call_id: str | None = None
    function_call: JsonValue = None  # OpenAI's legacy form of one tool call: {"name", "arguments"}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    chat_template_kwargs: dict[str, JsonValue] | None = None
    tools: list[JsonValue] | None = None  # functions the model may call (pegaserve/api/tools.py)
    tool_choice: JsonValue = None  # "none", "auto", "required" or {"type": "function", "function": {"name": ...}}
    parallel_tool_calls: StrictBool = True  # false: one call at most
    service_tier: Literal["auto", "default"] | None = None  # no effect: one tier
    metadata: dict[str, str] | None = None  # kept with a stored completion
    store: StrictBool = False  # kept for GET /v1/chat/completions/{id} (pegaserve/api/stored_chats.py)
    modalities: list[Literal["text"]] | None = None
    # The chat template's (`jobs.template_fields`): a template of the request's own where the server
    # trusts them, and what vLLM hands the template beside the messages
    chat_template: str | None = None
    documents: list[dict[str, JsonValue]] | None = None
    reasoning_effort: ReasoningEffort | None = None
    functions: list[JsonValue] | None = None  # OpenAI's legacy tools (pegaserve/api/tools.py, chat_tools)
    function_call: JsonValue = None  # and tool_choice: "none", "auto" or {"name": ...}
    prediction: JsonValue = None  # OpenAI's predicted output, {"type": "content", "content"}: drafts (jobs.py)
    # Refused unless at their defaults (`REFUSED`):
    audio: JsonValue = None
    web_search_options: JsonValue = None


class ChatUpdate(Body):
    """`POST /v1/chat/completions/{id}`: a stored completion's metadata, replaced (null: none)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    metadata: dict[str, str] | None = None


class TextFormat(Body):
    """The Responses API's `text.format`: what `response_format` is to chat."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, JsonValue] | None = Field(None, alias="schema")  # (a BaseModel attribute's name)
    strict: StrictBool | None = None
    description: str | None = None


class ResponseText(Body):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # OpenAI's default, the only one a model here can keep to


class ResponseReasoning(Body):
    effort: ReasoningEffort | None = None  # reaches the chat template, as chat's reasoning_effort
    summary: Literal["auto", "concise", "detailed"] | None = None  # refused: no reasoning is summarized here
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # (summary's old name)


class ResponsesStreamOptions(Body):
    include_obfuscation: StrictBool = False  # refused if true: no padding is added to deltas


Includable = Literal["message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
                     "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
                     "computer_call_output.output.image_url", "code_interpreter_call.outputs"]  # OpenAI's


class ResponsesRequest(SamplingKnobs):
    """OpenAI's Responses API (pegaserve/api/responses/endpoint.py), run as a chat completion: `input` and
    `instructions` become the messages, `max_output_tokens` the length limit, `text.format` the
    response format, `reasoning.effort` the template's reasoning effort; stored unless `store` is
    false, for `previous_response_id` to continue."""

    input: str | list[dict[str, JsonValue]]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = None
    stream: StrictBool = False
    stream_options: ResponsesStreamOptions | None = None
    tools: list[dict[str, JsonValue]] | None = None  # function tools: {"type": "function", "name", "parameters"...}
    tool_choice: JsonValue = None  # "none", "auto", "required" or {"type": "function", "name": ...}
    parallel_tool_calls: StrictBool = True
    text: ResponseText | None = None
    reasoning: ResponseReasoning | None = None
    # "auto": items left out from the conversation's start until it fits the context (responses.py)
    truncation: Literal["auto", "disabled"] = "disabled"
    chat_template_kwargs: dict[str, JsonValue] | None = None  # vLLM's, as chat's
    metadata: dict[str, str] | None = None  # echoed in the response (and kept with it when stored)
    service_tier: Literal["auto", "default"] | None = None  # no effect: one tier
    safety_identifier: str | None = None  # no effect: an end-user label, as `user`
    prompt_cache_key: str | None = None  # no effect: a routing hint; the prefix cache needs none
    # "message.output_text.logprobs": each output token's logprob (and the `top_logprobs` best); the
    # others add what no output here holds (reasoning, hosted tools' calls, images): no effect
    include: list[Includable] | None = None
    top_logprobs: StrictInt = 0
    store: StrictBool = True  # kept for `previous_response_id` and GET /v1/responses/{id} (response_store.py)
    previous_response_id: str | None = None
    background: StrictBool = False  # answered `queued` at once, generated on (pegaserve/api/responses/background.py)
    max_tool_calls: StrictInt | None = None  # a bound on built-in tools' calls: none run here (no effect)
    # Refused unless at their defaults (`REFUSED_RESPONSES`): conversations and prompts are not kept here
    prompt: JsonValue = None
    conversation: JsonValue = None


REFUSED_SHARED = ("kv_transfer_params", "vllm_xargs")
REFUSED_COMPLETION = (*REFUSED_SHARED, "suffix")
REFUSED_CHAT = (*REFUSED_SHARED, "audio", "web_search_options")
REFUSED_RESPONSES = ("prompt", "conversation")


class TokenizeRequest(Body):
    """vLLM's /tokenize: a `prompt`, or `messages` rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, JsonValue] | None = None
    chat_template: str | None = None  # as the chat endpoint's
    documents: list[dict[str, JsonValue]] | None = None
    reasoning_effort: ReasoningEffort | None = None
    return_token_strs: StrictBool = False


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[StrictInt] = Field(max_length=1_000_000)
