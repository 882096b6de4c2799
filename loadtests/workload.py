"""The load test's request mix: random but valid bodies, small enough for a CPU box.

A random-weight model almost never emits EOS or a guessed stop string, so the users remember the
greedy output of every prompt they have seen (`GreedyMemory`) and draws stop ids and stop strings from
it: at temperature 0 those stops really fire, and the contract's stop paths are exercised under
load. Nothing here assumes they fire; the checks judge whatever comes back.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from pegaserve.testing.contract import Answer, Params

MODEL = "qwen3-tiny"
MAX_TOKENS = 32  # keeps each request short on a 2-core CPU
MAX_TOP_LOGPROBS = 5
PROMPTS = (
    "Hello there",
    "The quick brown fox",
    "Once upon a time",
    "1, 2, 3, 4,",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Translate to French: good morning",
    "List three colors:",
)
FALLBACK_STOPS = ("\n", ".", " the", "ing")


@dataclass
class GreedyMemory:
    """(chat, prompt) -> the longest greedy continuation seen (token ids, text)."""

    outputs: dict[tuple[bool, str], tuple[tuple[int, ...], str]] = field(default_factory=dict)

    def get(self, chat: bool, prompt: str) -> tuple[tuple[int, ...], str] | None:
        return self.outputs.get((chat, prompt))

    def learn(self, chat: bool, prompt: str, body: dict, answer: Answer) -> None:
        """Only a single greedy choice with its token ids, unbent by min_tokens, is the model's
        greedy path (stops only cut it short)."""
        if body.get("temperature") != 0 or body.get("min_tokens") or len(answer.choices) != 1:
            return
        choice = answer.choices[0]
        if choice.token_ids is None:
            return
        known = self.outputs.get((chat, prompt))
        if known is None or len(choice.token_ids) > len(known[0]):
            self.outputs[(chat, prompt)] = (choice.token_ids, choice.text)


@dataclass(frozen=True)
class Planned:
    """One request to send: where, the JSON body, and the prompt it was built for."""

    chat: bool
    body: dict
    prompt: str
    batch: bool = False

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    @property
    def name(self) -> str:
        """The Locust statistics row."""
        kind = "chat" if self.chat else "completions"
        return f"{kind}{' batch' if self.batch else ''}{' stream' if self.body['stream'] else ''}"

    def params(self) -> Params:
        return Params.from_body(self.body, self.chat)


def plan_request(rng: random.Random, memory: GreedyMemory, chat: bool, stream: bool, batch: bool = False) -> Planned:
    prompt = rng.choice(PROMPTS)
    body: dict = {"model": MODEL, "max_tokens": rng.randint(1, MAX_TOKENS) if rng.random() < 0.2
                  else rng.randint(4, 16), "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = [prompt, rng.choice(PROMPTS)] if batch else prompt
    _sampling(rng, body)
    known = None if batch else memory.get(chat, prompt)
    _stops(rng, body, known)
    _extensions(rng, body, chat, stream)
    return Planned(chat, body, prompt, batch)


def _sampling(rng: random.Random, body: dict) -> None:
    if rng.random() < 0.7:
        body["temperature"] = 0
        return
    body["temperature"] = 1.0
    body["seed"] = rng.randrange(2**31)
    if rng.random() < 0.5:
        body["top_k"] = rng.choice((1, 20, 50))


def _stops(rng: random.Random, body: dict, known: tuple[tuple[int, ...], str] | None) -> None:
    """stop_token_ids and stop strings, from the remembered greedy output when there is one."""
    max_tokens = body["max_tokens"]
    ids, text = known or ((), "")
    if rng.random() < 0.4:
        if ids:
            j = rng.randrange(min(len(ids), max_tokens))
            body["stop_token_ids"] = sorted({ids[j], rng.choice(ids)})
            if rng.random() < 0.3:
                body["max_tokens"] = j + 1  # rule 5: a token stop on the last allowed token
        else:
            body["stop_token_ids"] = [rng.randrange(1000, 150_000) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.4:
        strings = [_substring(rng, text) for _ in range(rng.randint(1, 2))] if text else []
        strings = [s for s in strings if s] or [rng.choice(FALLBACK_STOPS)]
        body["stop"] = strings[0] if len(strings) == 1 and rng.random() < 0.5 else strings
        if rng.random() < 0.3:
            body["include_stop_str_in_output"] = True
    if rng.random() < 0.3:
        body["ignore_eos"] = True
    if rng.random() < 0.3:
        body["min_tokens"] = rng.randint(1, body["max_tokens"])


def _substring(rng: random.Random, text: str) -> str:
    start = rng.randrange(len(text))
    return text[start:start + rng.randint(1, 4)]


def _extensions(rng: random.Random, body: dict, chat: bool, stream: bool) -> None:
    if rng.random() < 0.3:
        if chat:
            body["logprobs"] = True
            if rng.random() < 0.7:
                body["top_logprobs"] = rng.randint(0, MAX_TOP_LOGPROBS)
        else:
            body["logprobs"] = rng.randint(0, MAX_TOP_LOGPROBS)
    if rng.random() < 0.6:
        body["return_token_ids"] = True
    if stream and rng.random() < 0.85:
        body["stream_options"] = {"include_usage": True}
