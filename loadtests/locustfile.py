"""Locust users that load pegaserve and check every answer against docs/contract.md (`make loadtest`).

Each task sends one OpenAI request from the mix in `workload.py`, reads it whole (a stream to its
`[DONE]`), checks it with `pegaserve.testing.contract`, and reads the request's ledger record
(every request by default; `--ledger-every N` samples). Any broken rule is a Locust failure named
by the rule, so a headless run exits non-zero. At the end the ledger summary must show no new
invariant violations.

    locust -f loadtests/locustfile.py --headless --host http://127.0.0.1:8000 -u 16 -r 16 -t 60s

Only 127.0.0.1 / localhost targets are accepted.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import requests
from locust import HttpUser, between, events, task

from loadtests.workload import GreedyMemory, Planned, plan_request
from pegaserve.testing.contract import (
    Answer,
    Malformed,
    Params,
    answer_from_body,
    answer_from_sse,
    check_answer,
    check_ledger,
    ledger_keys,
    shows_output,
)

log = logging.getLogger("loadtest")
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
DEFAULT_HOST = "http://127.0.0.1:8000"
REQUEST_TIMEOUT_S = 120
LEDGER_NAME = "/admin/ledger/[id]"


class ContractViolation(Exception):
    """One answer broke the contract; the message lists what broke."""


@dataclass
class RunState:
    """What the users of one run share (hung on the Locust environment as `contract_run`)."""

    memory: GreedyMemory = field(default_factory=GreedyMemory)  # shared: stops start firing sooner
    stop_causes: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # (row, finish, stop_reason type)
    violations_at_start: int | None = None  # the ledger summary's count; None: unreadable


@events.init_command_line_parser.add_listener
def _add_options(parser) -> None:
    parser.add_argument("--ledger-every", type=int, default=1, env_var="LOCUST_LEDGER_EVERY",
                        help="check the ledger record of every Nth request per user (0: never)")


@events.init.add_listener
def _start_run(environment, **_) -> None:
    host = environment.host or DEFAULT_HOST
    if urlsplit(host).hostname not in LOCAL_HOSTS:
        raise SystemExit(f"loadtest: refusing host {host!r}: only 127.0.0.1 / localhost")
    environment.contract_run = RunState()


@events.test_start.add_listener
def _ledger_baseline(environment, **_) -> None:
    try:
        environment.contract_run.violations_at_start = _ledger_violations(environment.host or DEFAULT_HOST)
    except requests.RequestException as exc:  # reported at the end, with the other failures
        log.error("cannot read the ledger summary: %s", exc)


@events.test_stop.add_listener
def _ledger_final(environment, **_) -> None:
    """The ledger checks invariants on every request, sampled or not: none may have broken."""
    run: RunState = environment.contract_run
    start = time.perf_counter()
    exception = None
    try:
        new = _ledger_violations(environment.host or DEFAULT_HOST) - (run.violations_at_start or 0)
        if run.violations_at_start is None:
            exception = ContractViolation("the ledger summary was unreadable at the start")
        elif new:
            exception = ContractViolation(f"rule 20: the ledger counted {new} new invariant violations")
    except requests.RequestException as exc:
        exception = exc
    environment.events.request.fire(request_type="CHECK", name="ledger summary", context={}, exception=exception,
                                    response_time=(time.perf_counter() - start) * 1000, response_length=0)
    causes = ", ".join(f"{'/'.join(k)}={v}" for k, v in sorted(run.stop_causes.items()))
    log.info("stop causes seen: %s", causes or "none")


def _ledger_violations(host: str) -> int:
    response = requests.get(f"{host}/admin/ledger", timeout=30)
    response.raise_for_status()
    return response.json()["invariant_violations"]


class ContractUser(HttpUser):
    host = DEFAULT_HOST
    wait_time = between(0.0, 0.2)

    def on_start(self) -> None:
        self.shared: RunState = self.environment.contract_run
        self.rng = random.Random()
        self.num_sent = 0

    @task(3)
    def completion(self) -> None:
        self.send(plan_request(self.rng, self.shared.memory, chat=False, stream=False))

    @task(3)
    def completion_stream(self) -> None:
        self.send(plan_request(self.rng, self.shared.memory, chat=False, stream=True))

    @task(2)
    def chat(self) -> None:
        self.send(plan_request(self.rng, self.shared.memory, chat=True, stream=False))

    @task(2)
    def chat_stream(self) -> None:
        self.send(plan_request(self.rng, self.shared.memory, chat=True, stream=True))

    @task(1)
    def completion_batch(self) -> None:
        self.send(plan_request(self.rng, self.shared.memory, chat=False, stream=self.rng.random() < 0.5, batch=True))

    def send(self, planned: Planned) -> None:
        params = planned.params()
        self.num_sent += 1
        start = time.perf_counter()
        with self.client.post(planned.path, json=planned.body, name=planned.name, stream=params.stream,
                              catch_response=True, timeout=REQUEST_TIMEOUT_S) as response:
            try:
                answer = self.read(response, planned, params, start)
                self.check_ledger(answer)
            except (ContractViolation, Malformed, requests.RequestException) as exc:
                log.warning("%s %s: %s | body %s", planned.name, response.headers.get("x-request-id"), exc,
                            planned.body)
                response.failure(exc)
                return
            response.success()
        self.shared.memory.learn(planned.chat, planned.prompt, planned.body, answer)
        for c in answer.choices:
            self.shared.stop_causes[(planned.name, str(c.finish_reason), type(c.stop_reason).__name__)] += 1

    def read(self, response, planned: Planned, params: Params, start: float) -> Answer:
        if response.status_code == 0:
            raise ContractViolation(f"no response: {response.error!r}")
        if response.status_code != 200:
            raise ContractViolation(f"HTTP {response.status_code}: {response.text[:300]}")
        if params.stream:
            answer = answer_from_sse(self.read_stream(response, planned.name, start), planned.chat)
        else:
            answer = answer_from_body(response.json(), planned.chat)
        problems = check_answer(answer, params)  # a stream's framing too
        if problems:
            raise ContractViolation("; ".join(problems))
        return answer

    def read_stream(self, response, name: str, start: float) -> list[str]:
        """The stream's non-empty lines. Locust timed only the headers: the row's time becomes the
        whole stream, and a `TTFT` row records the first chunk with content."""
        lines, first_s = [], None
        num_bytes = 0
        for raw in response.iter_lines():
            if not raw:
                continue
            num_bytes += len(raw)
            lines.append(raw.decode("utf-8"))
            if first_s is None and shows_output(lines[-1]):
                first_s = time.perf_counter() - start
        response.request_meta["response_time"] = (time.perf_counter() - start) * 1000
        response.request_meta["response_length"] = num_bytes
        if first_s is not None:
            self.environment.events.request.fire(request_type="TTFT", name=name, response_time=first_s * 1000,
                                                 response_length=0, exception=None, context={})
        return lines

    def check_ledger(self, answer: Answer) -> None:
        every = self.environment.parsed_options.ledger_every if self.environment.parsed_options else 1
        if not every or self.num_sent % every:
            return
        records = []
        for key in ledger_keys(answer):
            got = self.client.get(f"/admin/ledger/{key}", name=LEDGER_NAME, timeout=REQUEST_TIMEOUT_S)
            records.append(got.json() if got.status_code == 200 else None)
        problems = check_ledger(answer, records)
        if problems:
            raise ContractViolation("; ".join(problems))
