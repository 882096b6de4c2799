"""Replicas' ledger events on their direct connection to the ledger (deployments/ledger.py): in
order, batched, `record_now` back only once the ledger has recorded its events, and nothing lost
when the ledger dies and Ray restarts it. The ledger here is the actor's own class in this process,
reached through a stand-in for its Ray handle; killing it closes its connections, as a dead
process's would."""

import asyncio
from types import SimpleNamespace

import pytest

from pegaserve.deployments.ledger import LedgerActor, LedgerBuffer
from pegaserve.ledger import Arrived, Finished, TokensCommitted
from pegaserve.stop import Length

WAIT_S = 10.0


class Ledgers:
    """The ledger actor's handle as LedgerBuffer uses it (`await actor.channel.remote()`), answered by
    its current incarnation; `kill` ends one and starts the next from the same journal."""

    def __init__(self, journal: str) -> None:
        self.journal = journal
        self.unreachable = False
        self.incarnations: list[LedgerActor] = []
        self.connections: list = []
        self.channel = SimpleNamespace(remote=self._channel)
        self._start(acks=True)

    @property
    def current(self):
        return self.incarnations[-1]

    def _start(self, acks: bool) -> None:
        ledger = LedgerActor.__ray_actor_class__(max_records=100, journal=self.journal)
        serve = ledger._serve

        async def tracked(connection) -> None:
            self.connections.append(connection)
            if acks:
                await serve(connection)
            else:  # a ledger that stopped answering: it reads, records nothing, acknowledges nothing
                while await connection.recv() is not None:
                    pass

        ledger._listener.handler = tracked
        self.incarnations.append(ledger)

    async def _channel(self):
        if self.unreachable:
            raise RuntimeError("the ledger actor is unreachable")
        return await self.current.channel()

    def kill(self, next_acks: bool = True) -> None:
        self.current._listener.close()
        for connection in self.connections:
            connection.close()
        self.connections.clear()
        self._start(acks=next_acks)


def finish(request_id: str, tokens: tuple[int, ...]) -> list:
    return [TokensCommitted(request_id, tokens), Finished(request_id, Length(), 3, len(tokens))]


def run(coroutine) -> None:
    asyncio.run(asyncio.wait_for(coroutine, WAIT_S))


@pytest.fixture
def ledgers(tmp_path) -> Ledgers:
    return Ledgers(str(tmp_path / "journal.jsonl"))


def test_events_arrive_in_order_and_record_now_returns_once_recorded(ledgers):
    async def body() -> None:
        buffer = LedgerBuffer(ledgers, "app/Ingress#1")
        await buffer.record_now([Arrived("a", 3, 16)])  # connected: the rest rides the same connection
        buffer.record([TokensCommitted("a", (5,))])
        await buffer.record_now(finish("b", (7, 8)))  # b's events travel with a's queued ones
        record = ledgers.current.get("b")
        assert record["status"] == "finished" and record["completion_tokens"] == 2
        a = ledgers.current.get("a")
        assert [e["name"] for e in a["events"]] == ["arrived", "tokens_committed"]
        assert {e["component"] for e in a["events"]} == {"app/Ingress#1"}
        assert len(ledgers.connections) == 1  # one connection for every batch
        await asyncio.sleep(0.05)
        assert buffer._unacked == {}

    run(body())


def test_batches_the_ledger_did_not_acknowledge_go_again_to_the_restarted_ledger(ledgers):
    async def body() -> None:
        buffer = LedgerBuffer(ledgers, "app/Prefill#1")
        await buffer.record_now([Arrived("before", 3, 16)])
        ledgers.kill(next_acks=False)  # the next incarnation hangs: reads, never answers
        buffer.record([Arrived("lost", 3, 16)])
        await asyncio.sleep(0.3)  # sent to the hung ledger, not acknowledged
        assert ledgers.incarnations[-1].get("lost") is None and len(buffer._unacked) == 1
        ledgers.kill()  # Ray restarts it
        await buffer.record_now(finish("lost", (1, 2)))
        record = ledgers.current.get("lost")
        assert [e["name"] for e in record["events"]] == ["arrived", "tokens_committed", "finished"]
        assert record["violations"] == [] and record["prompt_tokens"] == 3
        assert ledgers.current.get("before") is None  # in flight when its ledger died: gone with it

    run(body())


def test_an_unreachable_ledger_holds_no_request_and_gets_its_events_once_back(ledgers):
    async def body() -> None:
        ledgers.unreachable = True
        buffer = LedgerBuffer(ledgers, "app/Ingress#1")
        await buffer.record_now(finish("x", (4,)))  # returns: the answer must not wait for the ledger
        assert ledgers.current.get("x") is None
        ledgers.unreachable = False
        for _ in range(100):
            if ledgers.current.get("x") is not None:
                break
            await asyncio.sleep(0.05)
        assert ledgers.current.get("x")["status"] == "finished"

    run(body())


class Frames:
    """A replica's connection as the ledger reads it: these frames, then its end; the acks it got."""

    def __init__(self, frames: list) -> None:
        self.frames, self.acks = list(frames), []

    async def recv(self):
        return self.frames.pop(0) if self.frames else None

    def send(self, seq) -> None:
        self.acks.append(seq)


def test_a_batch_sent_again_after_its_ack_was_lost_is_recorded_once(tmp_path):
    """A replica sends a batch again when its connection ended before the ack came (deployments/
    ledger.py LedgerBuffer): the ledger acknowledges it again and records it once."""
    ledger = LedgerActor.__ray_actor_class__(max_records=100, journal=str(tmp_path / "journal.jsonl"))
    first = [(1, [("app/Ingress#1", [Arrived("a", 3, 16), TokensCommitted("a", (5,))])])]
    again = [*first, (2, [("app/Ingress#1", [Finished("a", Length(), 3, 1)])])]
    asyncio.run(ledger._serve(Frames(first)))
    connection = Frames(again)
    asyncio.run(ledger._serve(connection))
    record = ledger.get("a")
    assert connection.acks == [1, 2]
    assert [e["name"] for e in record["events"]] == ["arrived", "tokens_committed", "finished"]
    assert record["violations"] == [] and ledger.summary()["invariant_violations"] == 0
