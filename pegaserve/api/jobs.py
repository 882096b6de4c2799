"""From a parsed body to a `Job`: the prompts' token ids (the chat template for chat), each
prompt's plan, the echo, and the wire format. Shared by the completions and chat endpoints; the
prompt rendering is also what /tokenize answers."""

from __future__ import annotations

import functools
from dataclasses import replace

import jinja2
from jinja2 import meta as jinja2_meta

from pegaserve.api import validation as v
from pegaserve.api.beam import BeamPlan
from pegaserve.api.errors import invalid
from pegaserve.api.frontend import Frontend, Job, new_response_id, now_s
from pegaserve.api.protocol import (
    REFUSED_CHAT,
    REFUSED_COMPLETION,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
    TokenizeRequest,
)
from pegaserve.api.stored_chats import StoredChat, check_metadata
from pegaserve.api.tools import ToolPlan, chat_tools
from pegaserve.api.validation import PromptPlan
from pegaserve.api.wire import Endpoint, Wire
from pegaserve.config import Limits
from pegaserve.tokenizer import Tokenizer

MAX_CLIENT_ID_CHARS = 256
# apply_chat_template's own arguments, and the fields the request has its own checked fields for
# (`template_fields`: a client's `chat_template` only where the server trusts them, as vLLM)
_TEMPLATE_RESERVED = {"messages", "add_generation_prompt", "continue_final_message", "tokenize", "tools",
                      "chat_template", "documents"}


def completion_job(frontend: Frontend, body: CompletionRequest, header_id: str | None) -> Job:
    v.check_model(body.model, frontend.model)
    v.check_refused(body, REFUSED_COMPLETION)
    prompts = _split_prompts(body.prompt)
    v.check_common(body, len(prompts), frontend.limits)
    num_top, listed = v.listed_logprobs(body, frontend.model, v.check_completion(body, frontend.limits), body.echo)
    banned, grammar = bad_words(frontend, body), v.structured_output(body)
    plans = []
    for prompt in prompts:
        raw = encode(frontend.tokenizer, prompt, body.add_special_tokens) if isinstance(prompt, str) else list(prompt)
        ids = v.check_prompt_ids(raw, body, frontend.model, "prompt", frontend.limits)
        echo = None
        if body.echo:  # the prompt as the client sent it, or (ids, or truncated) as the model saw it
            echo = prompt if isinstance(prompt, str) and len(ids) == len(raw) \
                else frontend.tokenizer.decode(list(ids), skip_special_tokens=False)
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        plans.append(v.plan_prompt(body, ids, frontend.model, frontend.limits, (max_tokens, "max_tokens"), num_top, echo,
                                   bad_words=banned, grammar=grammar, logprob_token_ids=listed))
    response_id = new_response_id("cmpl")
    wire = _wire(frontend, body, Endpoint.COMPLETIONS, response_id, num_top, echo=body.echo)
    return _job(body, response_id, header_id, plans, wire, v.beam_search(body, grammar), frontend.limits)


COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions (chat: the context left)


def chat_job(frontend: Frontend, body: ChatCompletionRequest, header_id: str | None) -> Job:
    v.check_model(body.model, frontend.model)
    v.check_refused(body, REFUSED_CHAT)
    v.check_common(body, 1, frontend.limits)
    num_top, listed = v.listed_logprobs(body, frontend.model, v.check_chat(body, frontend.limits))
    tools, tool_plan, tool_grammar = chat_tools(body)
    ids = v.check_prompt_ids(chat_prompt_ids(frontend, body, tools), body, frontend.model, "messages", frontend.limits)
    max_tokens = (body.max_completion_tokens, "max_completion_tokens")
    if body.max_completion_tokens is None:
        max_tokens = (body.max_tokens, "max_tokens")
    role = "assistant" if body.add_generation_prompt else body.messages[-1].role
    last = body.messages[-1]
    echo = message_text(last.content) if body.echo and last.role == role else ""  # vLLM's chat echo
    grammar = v.structured_output(body, tool_grammar)
    beam = v.beam_search(body, grammar)
    plan = replace(v.plan_prompt(body, ids, frontend.model, frontend.limits, max_tokens, num_top,
                                 bad_words=bad_words(frontend, body), grammar=grammar, logprob_token_ids=listed),
                   echo_text=echo,
                   prediction=predicted_tokens(frontend, body, grammar is not None or beam is not None))
    check_metadata(body.metadata)
    response_id = new_response_id("chatcmpl")
    wire = _wire(frontend, body, Endpoint.CHAT, response_id, num_top, role=role, tools=tool_plan)
    stored = None
    if body.store:
        stored = StoredChat([m.model_dump(mode="json", exclude_unset=True) for m in body.messages], body.metadata)
    return replace(_job(body, response_id, header_id, [plan], wire, beam, frontend.limits), stored=stored)


def chat_prompt_ids(frontend: Frontend, body: ChatCompletionRequest, tools: list[dict] | None) -> list[int]:
    """The prompt's token ids: `body`'s messages (and `tools`, as `chat_tools` gives them) rendered
    with the chat template, unchecked."""
    text = render_chat(frontend.tokenizer, body.messages, body.add_generation_prompt, body.continue_final_message,
                       body.chat_template_kwargs, tools, *template_fields(frontend, body))
    return encode(frontend.tokenizer, text, body.add_special_tokens)


def predicted_tokens(frontend: Frontend, body: ChatCompletionRequest, no_drafts: bool) -> tuple[int, ...]:
    """OpenAI's predicted output as the token ids the engine drafts from (`speculation.PredictionProposer`):
    verified as any draft, it changes no token (a draft changes no draw: sampler.py), and saves steps
    where it holds. `no_drafts`: the request takes none (a grammar, beam search), so a prediction would do
    nothing: a 400."""
    prediction = body.prediction
    if prediction is None:
        return ()
    content = prediction.get("content") if isinstance(prediction, dict) else None
    if not isinstance(prediction, dict) or prediction.get("type") != "content" \
            or not isinstance(content, str | list) or content == []:
        raise invalid("prediction", 'must be {"type": "content", "content": <text, or a list of text parts>}')
    if no_drafts:
        raise invalid("prediction", "not with a structured output, a tool choice that needs a grammar or beam "
                                    "search: they take no drafts")
    text = message_text(content, "prediction")
    ids = encode(frontend.tokenizer, text, False)
    if len(ids) > frontend.model.max_model_len:
        raise invalid("prediction", f"has {len(ids)} tokens, more than the context of {frontend.model.max_model_len}")
    return tuple(ids)


def _job(body: SamplingFields, response_id: str, header_id: str | None, plans: list, wire: Wire,
         beam: BeamPlan | None, limits: Limits) -> Job:
    _check_budget(plans, body.n, limits)
    options = body.stream_options
    return Job(
        response_id=response_id,
        client_request_id=client_request_id(header_id, body.request_id),
        prompts=tuple(plans),
        n=body.n,
        wire=wire,
        stream=body.stream,
        include_usage=bool(options and options.include_usage),
        continuous_usage=bool(options and options.continuous_usage_stats),
        beam=beam,
    )


def _check_budget(plans: list[PromptPlan], n: int, limits: Limits) -> None:
    """What one request may ask of the server: the tokens its choices hold in the KV cache at most,
    and the echoed prompt text its answer repeats in every choice."""
    work = n * sum(len(p.prompt_token_ids) + p.policy.max_tokens for p in plans)
    if limits.max_request_tokens is not None and work > limits.max_request_tokens:
        raise invalid("n", f"{len(plans)} prompt(s) times n={n} choices of prompt and max_tokens come to {work} "
                           f"tokens, past this server's max_request_tokens ({limits.max_request_tokens})")
    echoed = n * sum(len(p.echo_text.encode()) for p in plans)
    if echoed > limits.max_echo_bytes:
        raise invalid("echo", f"the prompt's text shown in each of {n * len(plans)} choices comes to {echoed} bytes, "
                              f"past this server's max_echo_bytes ({limits.max_echo_bytes})")


def _wire(frontend: Frontend, body: SamplingFields, endpoint: Endpoint, response_id: str, num_top: int | None,
          echo: bool = False, role: str = "assistant", tools: ToolPlan | None = None) -> Wire:
    tokenizer = frontend.tokenizer
    return Wire(endpoint=endpoint, response_id=response_id, model=frontend.model.name, created=now_s(),
                decode_token=lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False),
                num_top_logprobs=num_top, num_prompt_logprobs=body.prompt_logprobs,
                return_token_ids=body.return_token_ids, tokens_as_ids=body.return_tokens_as_token_ids, echo=echo,
                role=role, tools=tools)


def client_request_id(header_id: str | None, body_id: str | None) -> str | None:
    """The client's correlation id (the X-Request-Id header, else the body's request_id): kept in
    the ledger and the logs, never used as a key (two requests may share it)."""
    param, value = ("X-Request-Id", header_id) if header_id else ("request_id", body_id)
    if value is not None and len(value) > MAX_CLIENT_ID_CHARS:
        raise invalid(param, f"at most {MAX_CLIENT_ID_CHARS} characters, got {len(value)}")
    return value or None


def _split_prompts(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid("prompt", "the prompt is empty")
    if isinstance(prompt[0], int):  # the body's model admits no mixed list: one prompt of ids
        return [prompt]
    return list(prompt)


LONG_TEXT_CHARS = 8 << 10  # a few ms to tokenize: past it, tokenizing lets other threads run


def bad_words(frontend: Frontend, body: SamplingFields) -> tuple[tuple[int, ...], ...]:
    """`bad_words` as the token sequences the engine forbids (vLLM's reading): each word with its
    leading spaces stripped, and, where the tokenizer gives the word after a space other tokens of
    the same count (mid-text), those too."""
    words, limits = body.bad_words or [], frontend.limits
    if len(words) > limits.max_bad_words:
        raise invalid("bad_words", f"at most {limits.max_bad_words} words, got {len(words)}")
    sequences = []
    for word in words:
        bare = word.lstrip()
        if not bare or len(word) > limits.max_bad_word_chars:
            raise invalid("bad_words", f"each word must have 1 to {limits.max_bad_word_chars} characters and not be "
                                       f"only spaces, got {word[:40]!r}")
        alone = tuple(encode(frontend.tokenizer, bare, False))
        spaced = tuple(encode(frontend.tokenizer, " " + bare, False))
        sequences.append(alone)
        if spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    return tuple(dict.fromkeys(sequences))


def encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) < LONG_TEXT_CHARS:
        return tokenizer.backend.encode(text, add_special_tokens=add_special_tokens).ids
    # the same ids; `encode_batch` lets go of the GIL while it works, where `encode` holds it (a 4 MiB
    # prompt: seconds), so the app's event loop keeps streaming meanwhile (`app.off_the_loop_if_large`)
    return tokenizer.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def template_fields(frontend: Frontend, body: ChatCompletionRequest | TokenizeRequest) -> tuple[str | None, dict]:
    """The request's own chat template (None: the model's), where the server trusts them, and what
    else goes to the template beside the messages: `documents` and `reasoning_effort`, each only to
    a template that reads it (it would be ignored otherwise: a 400)."""
    template = body.chat_template
    if template is not None and not frontend.limits.trust_request_chat_template:
        raise invalid("chat_template", "this server renders only the model's chat template (its "
                                       "limits.trust_request_chat_template, vLLM's --trust-request-chat-template, "
                                       "allows a request's own)")
    if template is not None:
        try:
            names = _variables_of(template)
        except jinja2.TemplateSyntaxError as exc:
            raise invalid("chat_template", f"is not a valid Jinja template: {exc}") from None
    else:
        names = model_template_variables(frontend.tokenizer.hf.chat_template)
    extras = {name: getattr(body, name) for name in ("documents", "reasoning_effort") if getattr(body, name) is not None}
    for name in extras:
        if names is not None and name not in names:
            raise invalid(name, "the chat template does not read it")
        if name in (body.chat_template_kwargs or {}):
            raise invalid("chat_template_kwargs", f"sets {name}, which the request sets too")
    return template, extras


def model_template_variables(template: str | dict | None) -> frozenset[str] | None:
    """The names the model's chat template (or templates, by name) reads; None where jinja2 alone
    cannot parse it (a tag of transformers' own): then nothing is known to be unread."""
    sources = template.values() if isinstance(template, dict) else [template] if template else []
    try:
        return frozenset().union(*(_variables_of(source) for source in sources))
    except jinja2.TemplateSyntaxError:
        return None


@functools.lru_cache(maxsize=64)
def _variables_of(source: str) -> frozenset[str]:
    environment = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    return frozenset(jinja2_meta.find_undeclared_variables(environment.parse(source)))


def render_chat(tokenizer: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool,
                continue_final_message: bool, template_kwargs: dict | None, tools: list | None = None,
                template: str | None = None, extras: dict | None = None) -> str:
    """The conversation (and the tools the model may call) through the chat template (the model's,
    or `template`); every field a message sets is passed on, with `extras` (`template_fields`)."""
    reserved = _TEMPLATE_RESERVED & set(template_kwargs or ())
    if reserved:
        raise invalid("chat_template_kwargs", f"may not set {sorted(reserved)}")
    rendered = []
    for m in messages:
        message = m.model_dump(exclude_none=True, exclude={"content"})
        message["content"] = message_text(m.content)
        if message["role"] == "function":  # OpenAI's legacy tool answer, to a template as any tool's
            message["role"] = "tool"
        if "function_call" in message and "tool_calls" not in message:
            message["tool_calls"] = [{"type": "function", "function": message.pop("function_call")}]
        rendered.append(message)
    try:
        return tokenizer.hf.apply_chat_template(rendered, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                continue_final_message=continue_final_message, tools=tools,
                                                chat_template=template, **(template_kwargs or {}), **(extras or {}))
    except Exception as exc:  # a template that rejects the conversation is the client's problem
        raise invalid("chat_template" if template else "messages",
                      f"the chat template rejected the messages: {exc}") from exc


def message_text(content, param: str = "messages") -> str:
    """A message's (or a prediction's) content as text: a string, or the text of its text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise invalid(param, "only text content parts are supported")
        parts.append(part["text"])
    return "".join(parts)
