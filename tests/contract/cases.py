"""The stop contract as data: each case scripts what the model generates and says what the client
must see. The same cases run against the colocated server and the P/D Ray Serve app."""

from __future__ import annotations

from dataclasses import dataclass, field

EOS = 151645  # <|im_end|>
EOT = 151643  # <|endoftext|>
A, B, C = 64, 293, 272  # "a", " b", " c"
RUNNER_UP = 65  # "b": the scripted model's choice when its token is masked
HELLO, WORLD, HEL, LO = 9707, 1879, 32713, 385
EMOJI_BYTES = (172, 253, 247, 224)  # "🙂" as four byte-level tokens
ONE_COMMA_TWO = (220, 16, 11, 220, 17)  # " 1, 2"
VOCAB_SIZE = 151936


@dataclass(frozen=True)
class Case:
    name: str
    rules: tuple[int, ...]
    generated: tuple[int, ...]  # what the scripted model emits after the prompt
    params: dict
    text: str
    finish_reason: str
    stop_reason: int | str | None
    completion_tokens: int
    prompt_tail: tuple[int, ...] = ()  # extra prompt tokens (e.g. text the stop string must not see)
    chat: bool = False
    extra: dict = field(default_factory=dict)

    def prompt(self, index: int) -> tuple[int, ...]:
        """A prompt no other case's prompt is a prefix of."""
        return (151644, 40000 + index, 198, *self.prompt_tail)


CASES = [
    Case("eos_ends", (2, 12, 19), (A, B, EOS), {}, "a b", "stop", None, 3),
    Case("first_token_eos", (13, 21), (EOS,), {}, "", "stop", None, 1),
    Case("stop_id_17", (5, 7, 12), ONE_COMMA_TWO, {"stop_token_ids": [17]}, " 1, ", "stop", 17, 5),
    Case("stop_id_17_ignore_eos", (3, 7), ONE_COMMA_TWO, {"stop_token_ids": [17], "ignore_eos": True},
         " 1, ", "stop", 17, 5),
    Case("stop_id_17_included", (12,), ONE_COMMA_TWO,
         {"stop_token_ids": [17], "include_stop_str_in_output": True}, " 1, 2", "stop", 17, 5),
    Case("ignore_eos_length", (3, 12), (A, EOS, B, EOT, C, A, B, C, A), {"ignore_eos": True, "max_tokens": 8},
         "a b ca b c", "length", None, 8),
    Case("whole_vocab_stop_set", (21,), (HELLO, WORLD), {"stop_token_ids": list(range(VOCAB_SIZE))},
         "", "stop", HELLO, 1),
    Case("eos_also_stop_id", (4,), (A, EOS), {"stop_token_ids": [EOS]}, "a", "stop", None, 2),
    Case("eos_also_stop_id_ignore_eos", (4,), (A, EOS), {"stop_token_ids": [EOS], "ignore_eos": True},
         "a", "stop", EOS, 2),
    Case("stop_on_max_tokens_th", (5,), (A, B, C), {"max_tokens": 3, "stop_token_ids": [C]}, "a b", "stop", C, 3),
    Case("min_tokens_masks_eos", (6,), (EOS, EOS, EOS, EOS), {"min_tokens": 3}, "bbb", "stop", None, 4),
    Case("min_tokens_masks_stop_id", (6,), (C, C, C), {"min_tokens": 2, "stop_token_ids": [C]},
         "bb", "stop", C, 3),
    Case("max_tokens_1", (21,), (A, B), {"max_tokens": 1}, "a", "length", None, 1),
    Case("stop_string_spans_tokens", (9, 10), (HELLO, WORLD, EOS), {"stop": ["lo wo"]}, "Hel", "stop", "lo wo", 2),
    Case("stop_string_included", (10,), (HELLO, WORLD, EOS), {"stop": ["lo wo"], "include_stop_str_in_output": True},
         "Hello wo", "stop", "lo wo", 2),
    Case("stop_string_inside_one_token", (10,), (HELLO, WORLD), {"stop": ["ll"]}, "He", "stop", "ll", 1),
    Case("stop_string_first_token", (13, 21), (HELLO, WORLD), {"stop": ["He"]}, "", "stop", "He", 1),
    Case("held_then_released_at_end", (16,), (HELLO, WORLD, EOS), {"stop": [" world!"]},
         "Hello world", "stop", None, 3),
    Case("held_then_ruled_out", (16,), (HELLO, WORLD, A, EOS), {"stop": [" worldwide"]},
         "Hello worlda", "stop", None, 4),
    Case("earliest_end_wins", (9,), (HELLO, WORLD, EOS), {"stop": ["world", "o w"]}, "Hell", "stop", "o w", 2),
    Case("equal_ends_list_order", (9,), (HELLO, WORLD, EOS), {"stop": ["rld", "world"]},
         "Hello wo", "stop", "rld", 2),
    Case("equal_ends_list_order_2", (9,), (HELLO, WORLD, EOS), {"stop": ["world", "rld"]},
         "Hello ", "stop", "world", 2),
    Case("no_match_in_prompt", (8,), (LO, EOS), {"stop": ["Hello"]}, "lo", "stop", None, 2, prompt_tail=(HEL,)),
    Case("min_tokens_gates_stop_strings", (8,), (A, A, A, EOS), {"min_tokens": 2, "stop": ["a"]},
         "aa", "stop", "a", 3),
    Case("multibyte_stop_string", (14, 10), (HELLO, *EMOJI_BYTES, WORLD), {"stop": ["🙂"]},
         "Hello", "stop", "🙂", 5),
    Case("multibyte_text", (14, 15), (HELLO, *EMOJI_BYTES, WORLD, EOS), {}, "Hello🙂 world", "stop", None, 7),
    Case("partial_char_never_completed", (14,), (HELLO, *EMOJI_BYTES[:2], EOS), {"stop": ["🙂!"]},
         "Hello", "stop", None, 4),
    Case("special_tokens_skipped", (12,), (A, EOT, B, EOS), {"ignore_eos": True, "max_tokens": 4},
         "a b", "length", None, 4),
    Case("special_tokens_shown", (12,), (A, EOT, B, EOS), {"ignore_eos": True, "max_tokens": 3,
                                                            "skip_special_tokens": False},
         "a<|endoftext|> b", "length", None, 3),
    Case("logprobs_and_token_ids", (7, 19), ONE_COMMA_TWO,
         {"stop_token_ids": [17], "logprobs": 2, "return_token_ids": True}, " 1, ", "stop", 17, 5),
    Case("chat_eos", (12, 17), (A, B, EOS), {}, "a b", "stop", None, 3, chat=True),
    Case("chat_stop_string", (9, 17), (HELLO, WORLD, EOS), {"stop": "lo wo"}, "Hel", "stop", "lo wo", 2, chat=True),
    Case("chat_logprobs", (7,), (A, B, C), {"logprobs": True, "top_logprobs": 2, "max_completion_tokens": 3,
                                          "stop_token_ids": [C]}, "a b", "stop", C, 3, chat=True),
    # n choices of one prompt (each choice keeps every rule; usage sums them) and echo; appended so
    # every case above keeps its index (and its prompt).
    Case("n2_greedy_choices_agree", (17, 19), (A, B, EOS), {"n": 2}, "a b", "stop", None, 3),
    Case("n3_stop_string_in_each_choice", (10, 11, 17), (HELLO, WORLD, EOS), {"n": 3, "stop": ["lo wo"]},
         "Hel", "stop", "lo wo", 2),
    Case("echo_prompt_then_completion", (12, 19), (A, B, EOS), {"echo": True}, "<|im_start|> CW\na b", "stop",
         None, 3),
    Case("chat_n2", (17, 19), (A, B, EOS), {"n": 2}, "a b", "stop", None, 3, chat=True),
    Case("n2_echo_stop_id", (7, 12), ONE_COMMA_TWO, {"n": 2, "echo": True, "stop_token_ids": [17]},
         "<|im_start|> Opening\n 1, ", "stop", 17, 5),
]

CHAT_MESSAGES = lambda index: [{"role": "user", "content": f"contract case {index}"}]  # noqa: E731


def script(tokenizer) -> dict[tuple[int, ...], tuple[int, ...]]:
    """prompt ids -> generated ids for every case (chat prompts rendered with the model's template)."""
    out = {}
    for i, case in enumerate(CASES):
        out[prompt_ids(tokenizer, i)] = case.generated
    return out


def prompt_ids(tokenizer, index: int) -> tuple[int, ...]:
    case = CASES[index]
    if case.chat:
        return tuple(tokenizer.encode(tokenizer.apply_chat_template(CHAT_MESSAGES(index))))
    return case.prompt(index)
