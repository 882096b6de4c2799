"""Continuous batching with chunked prefill: each step, every running request gets its next tokens
(a decode token with its speculative drafts, or the next chunk of its prompt), then waiting
requests are admitted under the token budget; when blocks run out the newest running request is
preempted (its KV dropped, recomputed later). Under the priority policy the queues are ordered by
priority, then arrival: the lowest-ranked running request is the one preempted, and running
requests of a lower priority than the first waiting one make room for it.

The scheduler owns every `RequestState` and is the only caller of the KV cache manager, so a
request's progress and its blocks change only here: in `schedule()` (blocks for the step) and
`update()` (the sampled tokens, classified one at a time by the stop policy — docs/contract.md
rules 1-7 — and the progress they make). What each scheduled request asks of the runner is built in
scheduled_request.py.
"""

from __future__ import annotations

from bisect import insort
from collections import deque
from dataclasses import replace

from pegaserve.config import EngineConfig, Role
from pegaserve.kv.manager import KvCacheManager
from pegaserve.messages import EngineRequest, Handoff, ParkedKv, ReceiveTarget, SampledToken, StepOutput
from pegaserve.request import RequestState, Status
from pegaserve.sample.grammar import Grammars
from pegaserve.sched.leases import Leases
from pegaserve.sched.output import RunnerOutput, ScheduledRequest, SchedulerOutput
from pegaserve.sched.ranked_queue import RankedQueue, rank
from pegaserve.sched.scheduled import scheduled_request
from pegaserve.sched.speculation import Drafter, Proposer
from pegaserve.stop import Abort, Error, Length, StopCause


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KvCacheManager, max_model_len: int,
                 proposer: Proposer | None = None, grammars: Grammars | None = None) -> None:
        self.config = config
        self.grammars = grammars
        self.kv = kv
        self.block_size = kv.block_size
        self.max_model_len = max_model_len
        self.drafter = Drafter(proposer)
        self.by_priority = config.scheduling_policy == "priority"
        self.waiting: deque[RequestState] | RankedQueue = RankedQueue() if self.by_priority else deque()
        self.running: list[RequestState] = []  # by rank under the priority policy
        self.leases = Leases(config.lease_timeout_s)  # prefill role: first token out, blocks held for export
        self.receiving: dict[str, list[RequestState]] = {}  # decode role: request id -> choices awaiting KV
        self.requests: dict[str, RequestState] = {}  # every live choice, by choice id
        self.groups: dict[str, tuple[str, ...]] = {}  # request id -> its choice ids (n > 1 only)
        self.num_preemptions = 0
        self._scheduled: list[RequestState] = []  # the last schedule()'s requests, for update()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    # --- admission -------------------------------------------------------------------------------

    def add(self, request: EngineRequest) -> None:
        """Queue a new request: its first choice computes the prompt, the others fork from it."""
        lead, *forks = self._choices(request, range(request.n))
        lead.forks = forks
        self.waiting.append(lead)

    def receive(self, handoff: Handoff) -> ReceiveTarget | None:
        """Decode role: admit a prefilled request whose prompt KV is about to arrive. Its choices wait
        (RECEIVING) on blocks allocated after the prompt's cached prefix. None: no room now, so the
        choices recompute the prompt instead (queued); the tokens are the same either way."""
        choices = self._choices(handoff.request, [index for index, _ in handoff.choices])
        for choice, (_, tokens) in zip(choices, handoff.choices):
            for token in tokens:  # the first token (rule 22), or every token already given (a resume)
                choice.append(token, self.max_model_len)
        lead = choices[0]
        prefix = self.kv.find_cached_prefix(lead)
        num_live = len(self.running) + sum(len(c) for c in self.receiving.values())
        if num_live + len(choices) > self.config.max_num_seqs or not self.kv.allocate(
                lead, lead.num_prompt_tokens, prefix):
            self.waiting.extend(choices)
            return None
        self.kv.count_prefix_query(lead, prefix)
        for choice in choices:
            if choice is not lead:
                self.kv.fork(lead, choice)
            choice.num_cached_tokens = prefix.num_tokens(self.block_size)
            choice.set_status(Status.RECEIVING)
        self.receiving[handoff.request.request_id] = choices
        return ReceiveTarget(self.kv.block_ids(lead.request_id)[len(prefix.block_ids) :], len(prefix.block_ids))

    def received(self, request_id: str, ok: bool) -> None:
        """The handoff's KV is in its blocks (ok), or it never came: the choices recompute."""
        for choice in self.receiving.pop(request_id, []):
            if choice.finish is not None:  # aborted meanwhile: its blocks were kept until now
                self.kv.forget(choice)
                choice.set_status(Status.FINISHED)
            elif ok:
                choice.num_computed_tokens = choice.num_prompt_tokens
                choice.set_status(Status.RUNNING)
                self.kv.name_full_blocks(choice)
                self._run(choice)
            else:
                self.kv.free(choice)
                choice.set_status(Status.WAITING)
                self.waiting.append(choice)

    def _choices(self, request: EngineRequest, indices) -> list[RequestState]:
        choices = [RequestState(request, i) for i in indices]
        for choice in choices:
            assert choice.request_id not in self.requests, "the engine checks ids first"
            self.requests[choice.request_id] = choice
        if request.n > 1:
            self.groups[request.request_id] = tuple(c.request_id for c in choices)
        return choices

    def choice_ids(self, request_id: str) -> tuple[str, ...]:
        """A request's live choice ids (a choice id names just itself)."""
        ids = self.groups.get(request_id, (request_id,))
        return tuple(i for i in ids if i in self.requests)

    # --- one step: schedule ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput | None:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        copies: list[tuple[int, int]] = []
        self._scheduled = []
        if self.by_priority and self.waiting:
            self._make_room_for_rank(self.waiting[0])
        budget, num_preempted = self._schedule_running(budget, scheduled, copies)
        if num_preempted == 0:  # no room to spare this step: admit nothing new
            self._schedule_waiting(budget, scheduled, copies)
        if not scheduled:
            return None
        return SchedulerOutput(tuple(scheduled), tuple(copies))

    def _schedule_running(self, budget: int, scheduled: list, copies: list) -> tuple[int, int]:
        """Every running request's next tokens, front to back. Returns the budget left and how
        many requests were preempted for room."""
        num_preempted = 0
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._num_new_tokens(request, budget)
            fits, victims = self._make_room(request, request.num_computed_tokens + num_new)
            num_preempted += victims
            if not fits:
                break  # the request preempted itself: it was the last one
            copies += self.kv.prepare_write(request, request.num_computed_tokens)
            scheduled.append(self._scheduled_request(request, num_new))
            budget -= num_new
            i += 1
        return budget, num_preempted

    def _schedule_waiting(self, budget: int, scheduled: list, copies: list) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            prefix = self.kv.find_cached_prefix(request)
            start = prefix.num_tokens(self.block_size)
            num_new = min(request.num_tokens - start, budget)
            if not self.kv.allocate(request, start + num_new, prefix):
                break
            if request.num_cached_tokens is None:
                self.kv.count_prefix_query(request, prefix)
                request.num_cached_tokens = start
            self.waiting.popleft()
            request.num_computed_tokens = start
            request.set_status(Status.RUNNING)
            self._run(request)
            scheduled.append(self._scheduled_request(request, num_new))
            budget -= num_new

    def _run(self, request: RequestState) -> None:
        if self.by_priority:
            insort(self.running, request, key=rank)
        else:
            self.running.append(request)

    def _make_room_for_rank(self, head: RequestState) -> None:
        """Priority policy: preempt running requests of a lower priority than `head`, the first
        waiting one, while it could not start (no slot, or no blocks for its first chunk with one
        block to spare for each running request's next token)."""
        prefix = self.kv.find_cached_prefix(head)
        start = prefix.num_tokens(self.block_size)
        end = start + min(head.num_tokens - start, self.config.max_num_batched_tokens)
        while self.running and self.running[-1].engine_request.priority > head.engine_request.priority:
            need = self.kv.num_blocks_needed(head, end, prefix) + len(self.running)
            if len(self.running) < self.config.max_num_seqs and self.kv.pool.can_allocate(need):
                return
            self._preempt(self.running[-1])

    def _num_new_tokens(self, request: RequestState, budget: int) -> int:
        """The request's uncomputed tokens and drafts, cut to the budget (drafts go first)."""
        known = request.num_tokens - request.num_computed_tokens
        if known + len(request.draft_token_ids) > budget:
            request.draft_token_ids = request.draft_token_ids[: max(0, budget - known)]
        return min(known, budget) + len(request.draft_token_ids)

    def _make_room(self, request: RequestState, num_tokens: int) -> tuple[bool, int]:
        """Blocks for `num_tokens` of `request` (and its copy-on-write copies), preempting running
        requests from the back as needed. Returns whether `request` got them (False: it had to go
        itself) and how many requests were preempted."""
        num_preempted = 0
        while True:
            need = self.kv.num_blocks_needed(request, num_tokens)
            need += self.kv.num_copies_needed(request, request.num_computed_tokens)
            if self.kv.pool.can_allocate(need):
                self.kv.allocate(request, num_tokens)
                return True, num_preempted
            victim = self.running[-1]
            self._preempt(victim)
            num_preempted += 1
            if victim is request:
                return False, num_preempted

    def _preempt(self, request: RequestState) -> None:
        """Recompute preemption: drop the KV, keep the tokens, requeue at the front."""
        assert self.running[-1] is request
        self.running.pop()
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.draft_token_ids = ()
        request.set_status(Status.WAITING)
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _scheduled_request(self, request: RequestState, num_new: int) -> ScheduledRequest:
        self._scheduled.append(request)
        return scheduled_request(request, num_new, self.kv.block_ids(request.request_id), self.grammars)

    # --- one step: update ------------------------------------------------------------------------

    def update(self, output: SchedulerOutput, result: RunnerOutput) -> list[StepOutput]:
        """Apply a step's sampled tokens; return each choice's new tokens and finish."""
        outputs: list[StepOutput] = []
        for request, scheduled, tokens, scores in zip(self._scheduled, output.requests, result.sampled, result.scores):
            if scores:
                request.prompt_scores += scores
            if request.request_id not in self.requests and not request.forks:
                self._finish(request, Abort())  # abandoned while its choices still needed its prefill
            elif request.forks and scheduled.samples:
                outputs += self._fork(request, scheduled, tokens)
            elif scheduled.samples:
                outputs += self._advance(request, scheduled, tokens)
            else:
                request.num_computed_tokens += scheduled.num_tokens
                self.kv.name_full_blocks(request)
                if request.policy.max_tokens == 0 and request.num_computed_tokens == request.num_tokens:
                    outputs += self._score_only(request)
        self._scheduled = []
        self.running = [r for r in self.running if r.status is Status.RUNNING]
        return outputs

    def _advance(self, request: RequestState, scheduled: ScheduledRequest, tokens) -> list[StepOutput]:
        """A request's step with one or more sampled positions: the tokens up to the first rejected
        draft are accepted (a draft is accepted when the target sampled it), then classified one at
        a time; nothing after the first terminal token is kept (rule 1)."""
        drafts = [s.row.draft_token_id for s in scheduled.samples if s.row.draft_token_id is not None]
        num_accepted = self.drafter.verified(drafts, tokens)
        request.draft_token_ids = ()
        request.num_computed_tokens += scheduled.num_tokens
        predicted = bool(drafts) and request.drafts_predicted  # (before _emit proposes the next ones)
        output = self._emit(request, tokens[: num_accepted + 1])
        if predicted:  # kept: the accepted drafts up to a finish
            kept = min(num_accepted, len(output.tokens))
            output = replace(output, prediction_tokens=(kept, len(drafts) - kept))
        return [output]

    def _fork(self, lead: RequestState, scheduled: ScheduledRequest, tokens) -> list[StepOutput]:
        """The prompt is computed: every choice takes its first token, the others sharing the lead's
        blocks (the shared partial block is copied when a choice first writes into it)."""
        lead.num_computed_tokens += scheduled.num_tokens
        self.kv.name_full_blocks(lead)
        forks, lead.forks = lead.forks, []
        outputs = []
        for choice in forks:
            self.kv.fork(lead, choice)
            choice.num_computed_tokens = lead.num_computed_tokens
            choice.num_cached_tokens = lead.num_cached_tokens
            choice.prompt_scores = lead.prompt_scores  # the prompt's, complete now: the choices share it
            choice.set_status(Status.RUNNING)
            self._run(choice)
        for choice, token in zip((lead, *forks), tokens):
            if choice.request_id in self.requests:
                outputs.append(self._emit(choice, [token]))
            else:  # an abandoned lead: it computed the prompt for the others
                self._finish(choice, Abort())
        return outputs

    def _emit(self, request: RequestState, tokens: list[SampledToken]) -> StepOutput:
        kept = []
        cause: StopCause | None = None
        for token in tokens:
            kept.append(token)
            cause = request.append(token, self.max_model_len)
            if cause is not None:
                break
        first = request.num_output_tokens == len(kept)
        parked = None
        prompt_logprobs = tuple(request.prompt_scores) if first and request.prompt_scores is not None else None
        # KV up to the last token, not a rejected draft's: its full blocks are cached, finished or not
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        self.kv.name_full_blocks(request)
        if cause is not None:
            self._finish(request, cause)
        else:
            self.kv.truncate(request, request.num_tokens)
            if self.config.role is Role.PREFILL:
                parked = self._park(request)
            elif self.drafter.wants(request):
                room = min(request.policy.max_tokens - request.num_output_tokens,
                           self.max_model_len - request.num_tokens) - 1
                self.drafter.propose(request, room)
        return StepOutput(request.request_id, tuple(kept), cause, prompt_logprobs, parked,
                          request.num_cached_tokens if first else None)

    def _score_only(self, lead: RequestState) -> list[StepOutput]:
        """`max_tokens=0` (echo scoring): the prompt is scored, nothing is generated."""
        prompt_logprobs = tuple(lead.prompt_scores) if lead.prompt_scores is not None else None
        choices, lead.forks = (lead, *lead.forks), []
        outputs = [StepOutput(c.request_id, (), Length(), prompt_logprobs, num_cached_tokens=lead.num_cached_tokens)
                   for c in choices if c.request_id in self.requests]
        for choice in choices:
            self._finish(choice, Length())
        return outputs

    def _park(self, request: RequestState) -> ParkedKv:
        block_ids = self.kv.block_ids(request.request_id)
        return self.leases.park(request, block_ids, (self.kv.pool.generations[b] for b in block_ids))

    # --- leaving ---------------------------------------------------------------------------------

    def _finish(self, request: RequestState, cause: StopCause) -> None:
        """The request leaves every queue but `running` (the caller's) and gives its blocks back."""
        if request.finish is None:
            request.finish = cause
        if request.status is Status.WAITING and request in self.waiting:
            self.waiting.remove(request)
        self.leases.drop(request.request_id)
        self._forget_id(request)
        self.drafter.forget(request.request_id)
        self.kv.forget(request)
        request.set_status(Status.FINISHED)

    def _forget_id(self, request: RequestState) -> None:
        self.requests.pop(request.request_id, None)
        group_id = request.engine_request.request_id
        if group_id in self.groups and not any(c in self.requests for c in self.groups[group_id]):
            del self.groups[group_id]

    def abort(self, request_id: str) -> bool:
        """Abort a request (every choice) or one choice. False when there is nothing to abort."""
        choice_ids = self.choice_ids(request_id)
        for choice_id in choice_ids:
            self._abort_choice(self.requests[choice_id])
        return bool(choice_ids)

    def _abort_choice(self, request: RequestState) -> None:
        request.finish = Abort()
        if request.status is Status.RECEIVING:  # the transfer may still write its blocks: `received` frees
            self._forget_id(request)
            return
        lead = self._lead_of(request)
        if lead is not None:  # a choice still waiting for its prompt's prefill
            lead.forks.remove(request)
            self._forget_id(request)
            request.set_status(Status.FINISHED)
            if lead.request_id not in self.requests and not lead.forks:
                self._abort_choice(lead)  # an abandoned lead nobody waits for any more
            return
        if request.forks:  # the lead computes the prompt for its other choices: it goes on, unseen
            self._forget_id(request)
            return
        was_running = request.status is Status.RUNNING
        self._finish(request, Abort())
        if was_running:
            self.running.remove(request)

    def _lead_of(self, fork: RequestState) -> RequestState | None:
        if fork.index == 0 or fork.status is not Status.WAITING or fork in self.waiting:
            return None
        return next((r for r in (*self.running, *self.waiting) if fork in r.forks), None)

    def fail_running(self, message: str) -> list[StepOutput]:
        failed = list(dict.fromkeys([*self._scheduled, *self.running]))
        self._scheduled = []
        outputs = []
        for request in failed:
            if request.request_id in self.requests:
                outputs.append(StepOutput(request.request_id, (), Error(message)))
            for fork in request.forks:
                if fork.request_id in self.requests:
                    outputs.append(StepOutput(fork.request_id, (), Error(message)))
                    self._forget_id(fork)
                    fork.set_status(Status.FINISHED)
            request.forks = []
            if request.status is not Status.FINISHED:
                self._finish(request, Error(message))
        self.running = []
        return outputs

    def release(self, request_id: str) -> bool:
        """Prefill role: free a parked request's blocks (decode has its KV, or the lease expired)."""
        parked = self.parked_choices(request_id)
        for request in parked:
            self._finish(request, request.finish or Abort())
        return bool(parked)

    def parked_choices(self, request_id: str) -> list[RequestState]:
        return self.leases.of(self.choice_ids(request_id))

    def expire_leases(self, now: float) -> list[str]:
        """Free parked requests whose lease ran out (decode never came); returns their ids."""
        expired = self.leases.expired(now)
        for request in expired:
            self._finish(request, request.finish or Abort())
        return [request.request_id for request in expired]
