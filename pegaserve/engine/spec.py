"""Speculative proposals: guesses of a request's next tokens, verified by the target model in one
step (the runner scores the last token and every draft together; the sampler accepts or corrects
each in turn). A proposer only guesses: a wrong draft costs compute, never a token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from pegaserve.engine.config import SpeculativeConfig


class Proposer(ABC):
    """Interface a draft-model or MTP proposer could implement as well."""

    @abstractmethod
    def propose(self, request_id: str, token_ids: Sequence[int], max_drafts: int) -> tuple[int, ...]:
        """Up to `max_drafts` tokens to follow `token_ids` (the request's prompt and output so far)."""

    @abstractmethod
    def forget(self, request_id: str) -> None:
        """The request finished, was aborted or preempted: drop what was kept for it."""


class NgramProposer(Proposer):
    """Prompt lookup: find the most recent earlier occurrence of the context's last n tokens
    (longest n first) and propose the tokens that followed it.

    Each request keeps an index per n from an n-gram to the position just after its latest
    occurrence, extended as the context grows, so a proposal costs O(new tokens), not O(context).
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_draft_tokens
        self.sizes = range(config.prompt_lookup_max, config.prompt_lookup_min - 1, -1)
        self._index: dict[str, tuple[list[int], dict[int, dict[tuple[int, ...], int]]]] = {}

    def propose(self, request_id: str, token_ids: Sequence[int], max_drafts: int) -> tuple[int, ...]:
        max_drafts = min(max_drafts, self.k)
        if max_drafts <= 0:
            return ()
        indexed, index = self._index.setdefault(request_id, ([0], {n: {} for n in self.sizes}))
        end = len(token_ids)
        # n-grams ending before `end` (exclusive ends indexed[0] .. end - 1) enter the index first,
        # so the lookup below finds an earlier occurrence, never the context's own suffix
        for stop in range(max(indexed[0], 1), end):
            for n, grams in index.items():
                if stop >= n:
                    grams[tuple(token_ids[stop - n : stop])] = stop
        indexed[0] = max(indexed[0], end)
        for n, grams in index.items():
            if end < n:
                continue
            follow = grams.get(tuple(token_ids[end - n :]))
            if follow is not None:
                return tuple(token_ids[follow : min(follow + max_drafts, end)])
        return ()

    def forget(self, request_id: str) -> None:
        self._index.pop(request_id, None)


def make_proposer(config: SpeculativeConfig | None) -> Proposer | None:
    return None if config is None else NgramProposer(config)
