"""A row of the sampler's batch (`SamplingRow`: its params and the context they read), and the
processing of its logits before temperature, in vLLM's order (sampler.py's docstring): logit_bias,
repetition, frequency and presence penalties, then the masks: allowed_token_ids (every other token),
a grammar's bitmask, and min_tokens' and bad words' ids. Each phase is batched over the rows that use
it, and a no-op when none do; all of them write into the rows' own copy. (vLLM masks by
allowed_token_ids first: the same floats, as every phase keeps -inf at -inf.)

Every phase maps each logit alone, by float32 ops that never turn a larger logit into a smaller one:
screened.py's draw by rejection relies on it (processed upper bounds bound processed logits). A new
phase, all in this file: its function in its place in `edit_rows`, its term in `SamplingRow.edited`
(the gate the sampler asks of every row every step, kept inline for that), and what of a row bears on
one column in `_at_column` (for `edit_at`).
"""

from __future__ import annotations

import array
import dataclasses
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from pegaserve.messages import SamplingParams
from pegaserve.sample.grammar import allowed_by


@dataclass(frozen=True)
class SamplingRow:
    """One row of a step's logits: whose sampling it is and the context it reads. The engine fills
    `output_token_ids` only when `params.has_penalties`, `prompt_token_ids` only for
    repetition_penalty; the sampler reads them only then."""

    params: SamplingParams
    num_output_tokens: int  # the sampled token's 0-based position among generated ones: keys the seed
    masked_token_ids: frozenset[int] = frozenset()  # min_tokens (docs/contract.md rule 6), bad words
    output_token_ids: tuple[int, ...] = ()  # generated so far (presence/frequency/repetition)
    prompt_token_ids: tuple[int, ...] = ()  # repetition_penalty covers prompt + output
    draft_token_id: int | None = None  # a speculative proposal for this position: no draw reads it (sampler.py)
    stream: int = 0  # where its uniforms start among those of its (seed, position) (draw.uniform)
    token_bitmask: torch.Tensor | None = None  # its grammar's allowed tokens (grammar.Constraint.bitmask)

    @property
    def edited(self) -> bool:
        """Whether its logits differ from the raw ones before temperature: some phase of
        `edit_rows` applies to it. Asked of every row every step, so inline."""
        params = self.params
        return bool(self.masked_token_ids or params.logit_bias) or params.has_penalties \
            or params.allowed_token_ids is not None or self.token_bitmask is not None

    @property
    def wants_logprob(self) -> bool:
        """Whether its sampled token's logprob is wanted: asked for. As vLLM's, none is computed
        otherwise, a choice's first token's neither (the handoff and the ledger carry None).
        Else its `SampledToken.logprob` is None."""
        return self.params.num_top_logprobs is not None


def edit_rows(work: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Applies each row's processing to its row of `work` (`[rows, vocab]`, contiguous float32: the
    rows' own copy of their logits), in place."""
    _add_bias(work, rows)
    _apply_penalties(work, rows)
    _mask(work, rows)


def edit_at(values: torch.Tensor, columns: Sequence[int], rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Row i's processed logit at `columns[i]` from its raw one `values[i]` (float32): the very ops
    `edit_rows` applies there in a whole row, on a one-column copy of each row that keeps only what bears
    on that column (as column 0), so the two are the same float."""
    work = values.reshape(-1, 1).clone()
    edit_rows(work, [_at_column(row, column) for row, column in zip(rows, columns)])
    return work[:, 0]


def _at_column(row: SamplingRow, column: int) -> SamplingRow:
    if not row.edited:
        return row
    params = row.params
    return dataclasses.replace(
        row,
        params=dataclasses.replace(
            params, logit_bias=tuple((0, b) for t, b in params.logit_bias if t == column),
            allowed_token_ids=None if params.allowed_token_ids is None
            else frozenset({0}) if column in params.allowed_token_ids else frozenset()),
        masked_token_ids=frozenset({0}) if column in row.masked_token_ids else frozenset(),
        token_bitmask=None if row.token_bitmask is None
        else torch.tensor([(int(row.token_bitmask[column // 32]) >> (column % 32)) & 1], dtype=torch.int32),
        output_token_ids=(0,) * row.output_token_ids.count(column),
        prompt_token_ids=(0,) * row.prompt_token_ids.count(column),
    )


def _add_bias(work: torch.Tensor, rows: list[SamplingRow]) -> None:
    biased = [(j, row.params.logit_bias) for j, row in enumerate(rows) if row.params.logit_bias]
    if biased:
        index = _flat_index(work.shape[1], [(j, [t for t, _ in bias]) for j, bias in biased])
        values = torch.tensor([b for _, bias in biased for _, b in bias], dtype=work.dtype)
        work.view(-1).index_put_((index,), values, accumulate=True)


def _mask(work: torch.Tensor, rows: list[SamplingRow]) -> None:
    for j, row in enumerate(rows):
        if row.params.allowed_token_ids is not None:
            index = _index_of(row.params.allowed_token_ids)
            kept = work[j].index_select(0, index)
            work[j].fill_(float("-inf")).index_copy_(0, index, kept)
        if row.token_bitmask is not None:
            work[j].masked_fill_(~allowed_by(row.token_bitmask, work.shape[1]), float("-inf"))
    masked = [(j, row.masked_token_ids) for j, row in enumerate(rows) if row.masked_token_ids]
    if masked:
        work.view(-1).index_fill_(0, _flat_index(work.shape[1], masked), float("-inf"))


def bad_word_bans(bad_words: Sequence[Sequence[int]], output_token_ids: Sequence[int]) -> frozenset[int]:
    """The tokens `bad_words` (token sequences) forbid next: each word's last token where the output so
    far ends with the word's other tokens (a one-token word's, always). vLLM's rule; the engine masks
    them with the min_tokens mask."""
    banned = set()
    for word in bad_words:
        start = len(output_token_ids) - (len(word) - 1)
        if start >= 0 and all(output_token_ids[start + i] == t for i, t in enumerate(word[:-1])):
            banned.add(word[-1])
    return frozenset(banned)


@functools.lru_cache(maxsize=256)
def _index_of(token_ids: frozenset[int]) -> torch.Tensor:
    """A request's allowed ids as an index, made once (a set may hold most of the vocabulary)."""
    return torch.tensor(sorted(token_ids), dtype=torch.long)


def _apply_penalties(work: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab, flat = work.shape[1], work.view(-1)
    repeated = [(j, row) for j, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    if repeated:
        # A token seen twice is read twice and written twice with the same value: no need to dedupe.
        index = _flat_index(vocab, [(j, row.prompt_token_ids + row.output_token_ids) for j, row in repeated])
        penalty = torch.tensor([row.params.repetition_penalty for row in rows], dtype=work.dtype)[index // vocab]
        values = flat[index]
        flat[index] = torch.where(values > 0, values / penalty, values * penalty)
    counted = [
        (j, row.output_token_ids)
        for j, row in enumerate(rows)
        if (row.params.frequency_penalty != 0.0 or row.params.presence_penalty != 0.0) and row.output_token_ids
    ]
    if counted:
        index, counts = _flat_index(vocab, counted).unique(return_counts=True)
        row_of = index // vocab
        frequency = torch.tensor([row.params.frequency_penalty for row in rows], dtype=work.dtype)[row_of]
        presence = torch.tensor([row.params.presence_penalty for row in rows], dtype=work.dtype)[row_of]
        flat.index_add_(0, index, -(frequency * counts + presence))


def _flat_index(vocab: int, id_lists: Iterable[tuple[int, Iterable[int]]]) -> torch.Tensor:
    """Indices into a flattened contiguous `[rows, vocab]` tensor of each (row, token ids)."""
    row_ids, parts = [], []
    for j, token_ids in id_lists:
        row_ids.append(j)
        parts.append(_id_tensor(token_ids))
    ids = torch.cat(parts)
    assert not ids.numel() or (int(ids.min()) >= 0 and int(ids.max()) < vocab), "token id outside the vocabulary"
    offsets = torch.tensor(row_ids) * vocab
    return ids + offsets.repeat_interleave(torch.tensor([len(p) for p in parts]))


def _id_tensor(token_ids: Iterable[int]) -> torch.Tensor:
    # through an array: ~4x faster than torch.tensor() on a tuple of a long prompt's ids
    ids = array.array("q", token_ids)
    return torch.frombuffer(ids, dtype=torch.long) if ids else torch.empty(0, dtype=torch.long)
