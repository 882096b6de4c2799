"""vLLM's `/tokenize` and `/detokenize`: the served tokenizer and chat template, as the
generation endpoints use them."""

from __future__ import annotations

from pegaserve.api import validation as v
from pegaserve.api.errors import invalid
from pegaserve.api.frontend import Frontend
from pegaserve.api.jobs import encode, render_chat, template_fields
from pegaserve.api.protocol import DetokenizeRequest, TokenizeRequest


def tokenize(frontend: Frontend, body: TokenizeRequest) -> dict:
    """`prompt` (special tokens added by default) or `messages` (rendered; none added by default)."""
    v.check_model(body.model, frontend.model)
    if (body.prompt is None) == (body.messages is None):
        raise invalid("prompt", "give exactly one of prompt and messages")
    if body.messages is not None:
        if body.continue_final_message and body.add_generation_prompt:
            raise invalid("continue_final_message", "cannot be used with add_generation_prompt (set it to false)")
        text = render_chat(frontend.tokenizer, body.messages, body.add_generation_prompt, body.continue_final_message,
                           body.chat_template_kwargs, None, *template_fields(frontend, body))
        ids = encode(frontend.tokenizer, text, bool(body.add_special_tokens))
    else:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = encode(frontend.tokenizer, body.prompt, add_special)
    answer = {"count": len(ids), "max_model_len": frontend.model.max_model_len, "tokens": ids}
    if body.return_token_strs:
        answer["token_strs"] = frontend.tokenizer.hf.convert_ids_to_tokens(ids)
    return answer


def detokenize(frontend: Frontend, body: DetokenizeRequest) -> dict:
    v.check_model(body.model, frontend.model)
    v.check_vocabulary("tokens", body.tokens, frontend.model.vocab_size)
    return {"prompt": frontend.tokenizer.decode(body.tokens, skip_special_tokens=False)}
