"""Speculative proposals: guesses of a request's next tokens, verified by the target model in one
step (the runner scores the last token and every draft together; the sampler accepts or corrects
each in turn). A proposer only guesses: a wrong draft costs compute, never a token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from pegaserve.config import SpeculativeConfig
from pegaserve.messages import SampledToken
from pegaserve.request import RequestState


@dataclass
class SpecStats:
    """What speculation did in an engine (its scheduler counts; /admin/stats and metrics show it)."""

    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # drafts the target model agreed with
    num_steps: int = 0  # verification steps (request-steps that carried drafts)
    num_emitted_tokens: int = 0  # tokens those steps produced (accepted + one sampled each)


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


PREDICTION_DRAFTS = 8  # drafts per step from a predicted output: a long match is its point
PREDICTION_GRAMS = (3, 2)  # n-grams of the output that find its place in the prediction again


class PredictionProposer:
    """OpenAI's predicted outputs: drafts from the tokens a request predicts its output will be
    (`EngineRequest.prediction`), verified as any draft: the output is what it would have been
    (sampler.py: a draft changes no draw).

    The proposer follows the prediction while the output does: after each token that is the
    prediction's next, it proposes what comes after it. Where the output departs, it finds its place
    again from the output's last 3 (else 2) tokens: their first occurrence in the prediction after
    the place it lost (else anywhere); until then it proposes nothing.
    """

    def __init__(self, max_drafts: int = PREDICTION_DRAFTS) -> None:
        self.max_drafts = max_drafts
        self._places: dict[str, list] = {}  # request id -> [place in the prediction or None, tokens read]
        self._grams: dict[str, dict[tuple[int, ...], list[int]]] = {}  # request id -> n-gram -> its ends

    def propose(self, request_id: str, prediction: Sequence[int], output: Sequence[int],
                max_drafts: int) -> tuple[int, ...]:
        place, num_read = self._places.setdefault(request_id, [0, 0])
        for i in range(num_read, len(output)):
            if place is not None and place < len(prediction) and prediction[place] == output[i]:
                place += 1
            else:
                place = self._find(request_id, prediction, output[max(0, i + 1 - max(PREDICTION_GRAMS)) : i + 1], place)
        self._places[request_id] = [place, len(output)]
        if place is None or max_drafts <= 0:
            return ()
        return tuple(prediction[place : place + min(max_drafts, self.max_drafts)])

    def _find(self, request_id: str, prediction: Sequence[int], last: Sequence[int], lost: int | None) -> int | None:
        """Where the prediction continues the output's `last` tokens (see above), or None."""
        grams = self._grams.get(request_id)
        if grams is None:
            grams = self._grams[request_id] = {}
            for n in PREDICTION_GRAMS:
                for end in range(n, len(prediction) + 1):
                    grams.setdefault(tuple(prediction[end - n : end]), []).append(end)
        for n in PREDICTION_GRAMS:
            ends = grams.get(tuple(last[-n:])) if len(last) >= n else None
            if ends:
                return next((end for end in ends if lost is None or end >= lost), ends[0])
        return None

    def forget(self, request_id: str) -> None:
        self._places.pop(request_id, None)
        self._grams.pop(request_id, None)


def make_proposer(config: SpeculativeConfig | None) -> Proposer | None:
    return None if config is None else NgramProposer(config)


class Drafter:
    """A scheduler's speculation: a request's drafts for its next step (from its predicted output,
    else from the proposer), and the count of what verification accepted (`stats`)."""

    def __init__(self, proposer: Proposer | None) -> None:
        self.proposer = proposer
        self.predictions = PredictionProposer()  # drafts from the requests' predicted outputs
        self.stats = SpecStats()

    def wants(self, request: RequestState) -> bool:
        """Whether `request` takes drafts (none under a grammar)."""
        return (self.proposer is not None or bool(request.engine_request.prediction)) and request.sampling.grammar is None

    def propose(self, request: RequestState, room: int) -> None:
        """Sets the request's drafts (at most `room`): its predicted output's, else the proposer's."""
        drafts: tuple[int, ...] = ()
        if request.engine_request.prediction:
            drafts = self.predictions.propose(request.request_id, request.engine_request.prediction,
                                              request.output_token_ids, room)
        request.drafts_predicted = bool(drafts)
        if not drafts and self.proposer is not None:
            drafts = self.proposer.propose(request.request_id, request.all_token_ids(), room)
        request.draft_token_ids = drafts

    def verified(self, drafts: Sequence[int], tokens: Sequence[SampledToken]) -> int:
        """How many of `drafts` the target model sampled too (up to the first it did not)."""
        num_accepted = 0
        while num_accepted < len(drafts) and tokens[num_accepted].token_id == drafts[num_accepted]:
            num_accepted += 1
        if drafts:
            self.stats.num_steps += 1
            self.stats.num_draft_tokens += len(drafts)
            self.stats.num_accepted_tokens += num_accepted
            self.stats.num_emitted_tokens += num_accepted + 1
        return num_accepted

    def forget(self, request_id: str) -> None:
        if self.proposer is not None:
            self.proposer.forget(request_id)
        self.predictions.forget(request_id)
