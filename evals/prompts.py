"""The token ids lm_eval's local-completions client sent for each logged sample.

lm_eval logs a sample's arguments as text; with `tokenized_requests=True` the client sends token
ids. This rebuilds them with the client's own code (`_encode_pair`, `batch_loglikelihood_requests`,
the rolling windows of `loglikelihood_rolling`), from the client built with the run's model_args,
so the checker can pair every sample with the recorded request that answered it.
"""

from __future__ import annotations

from dataclasses import dataclass

from lm_eval import utils
from lm_eval.models.openai_completions import LocalCompletionsAPI


@dataclass(frozen=True)
class Scored:
    """One loglikelihood request: `token_ids` sent, the first `num_context_tokens` are context."""

    token_ids: tuple[int, ...]
    num_context_tokens: int


@dataclass(frozen=True)
class Generated:
    """One generate-until request."""

    token_ids: tuple[int, ...]
    max_tokens: int
    until: tuple[str, ...]


class Prompts:
    def __init__(self, model_args: str) -> None:
        # Built offline: the constructor loads the tokenizer and opens no connection.
        self.client = LocalCompletionsAPI.create_from_arg_string(model_args)

    @property
    def eos_string(self) -> str | None:
        return self.client.eos_string

    def scored(self, context: str, continuation: str) -> Scored:
        client = self.client
        if context == "":  # as TemplateLM.loglikelihood: the prefix token stands for an empty context
            continuation_ids = client.tok_encode(continuation, add_special_tokens=False)
            if client.prefix_token_id != continuation_ids[0]:
                context_ids = [client.prefix_token_id]
            else:
                context_ids, continuation_ids = continuation_ids[:1], continuation_ids[1:]
        else:
            context_ids, continuation_ids = client._encode_pair(context, continuation)
        return self._window(context_ids, continuation_ids)

    def rolling(self, text: str) -> list[Scored]:
        client = self.client
        windows = utils.get_rolling_token_windows(
            token_list=client.tok_encode(text), prefix_token=client.prefix_token_id,
            max_seq_len=client.max_length - 1, context_len=1,
        )
        return [self._window(*utils.make_disjoint_window(w)) for w in windows]

    def generated(self, context: str, gen_kwargs: dict) -> Generated:
        client = self.client
        max_tokens = int(gen_kwargs.get("max_gen_toks", client._max_gen_toks))
        token_ids = client.tok_encode([context], add_special_tokens=client.add_bos_token)[0]
        if client.tokenized_requests:
            token_ids = token_ids[-(client.max_length - max_tokens):]
        until = gen_kwargs.get("until") or []
        return Generated(tuple(token_ids), max_tokens, tuple([until] if isinstance(until, str) else until))

    def _window(self, context_ids: list[int], continuation_ids: list[int]) -> Scored:
        inputs, num_context, _ = self.client.batch_loglikelihood_requests([[(None, context_ids, continuation_ids)]])
        return Scored(tuple(inputs[0]), num_context[0])
