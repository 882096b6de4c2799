"""The ledger's invariants, its bounded memory and its journal (no Ray)."""

from pegaserve.ledger import Arrived, Finished, Ledger, Prefilled, TokensCommitted
from pegaserve.stop import Eos, Length, String, Token


def finish(ledger: Ledger, rid: str, tokens: tuple[int, ...], cause, completion: int | None = None) -> dict:
    ledger.record([Arrived(rid, 3, 16), Prefilled(rid, tokens[0], -0.5, "prefill#1")], "ingress")
    ledger.record([TokensCommitted(rid, tokens),
                   Finished(rid, cause, 3, len(tokens) if completion is None else completion)], "ingress")
    return ledger.get(rid)


def test_a_consistent_record_has_no_violations():
    ledger = Ledger()
    record = finish(ledger, "a", (5, 6, 17), Token(17))
    assert record["violations"] == [] and record["status"] == "finished"
    assert record["stop_cause"] == {"kind": "token", "token_id": 17, "text": None}
    assert record["finish_reason"] == "stop" and record["stop_reason"] == 17
    assert record["first_token"] == {"id": 5, "logprob": -0.5} and record["handoff"] is None
    assert [e["name"] for e in record["events"]] == ["arrived", "prefilled", "tokens_committed", "finished"]
    assert ledger.summary()["invariant_violations"] == 0


def test_usage_that_disagrees_with_the_committed_tokens_is_a_violation():
    ledger = Ledger()
    assert finish(ledger, "a", (5, 6), Length(), completion=3)["violations"]
    assert ledger.summary()["invariant_violations"] == 1


def test_a_trigger_that_is_not_the_last_token_is_a_violation():
    ledger = Ledger()
    assert finish(ledger, "a", (151645, 6), Eos(151645))["violations"]


def test_a_second_terminal_event_is_a_violation():
    ledger = Ledger()
    finish(ledger, "a", (5,), String("x"))
    ledger.record([Finished("a", Length(), 3, 1)], "ingress")
    assert "more than one terminal event" in ledger.get("a")["violations"]


def test_memory_is_bounded():
    ledger = Ledger(max_records=10)
    for i in range(50):
        finish(ledger, f"r{i}", (5,), Length())
    summary = ledger.summary()
    assert summary["num_records"] == 10 and summary["num_evicted"] == 40
    assert ledger.get("r0") is None and ledger.get("r49") is not None
    assert summary["by_status"]["finished"] == 50


def test_a_new_ledger_reloads_finished_records_from_the_journal(tmp_path):
    journal = tmp_path / "ledger.jsonl"
    ledger = Ledger(journal=journal)
    finish(ledger, "done", (5, 17), Token(17))
    ledger.record([Arrived("in-flight", 3, 16)], "ingress")
    restarted = Ledger(journal=journal)
    assert restarted.get("done") == ledger.get("done")
    assert restarted.get("in-flight") is None  # only finished records are journaled
    assert restarted.summary()["by_stop_cause"] == {"token": 1}
    finish(restarted, "later", (5,), Length())  # and it keeps journaling
    assert Ledger(journal=journal).get("later")["completion_tokens"] == 1


def test_the_clients_request_id_is_a_label_in_the_record_and_the_journal(tmp_path):
    journal = tmp_path / "ledger.jsonl"
    ledger = Ledger(journal=journal)
    for rid in ("cmpl-1", "cmpl-2"):  # two requests, one client id
        ledger.record([Arrived(rid, 3, 16, client_request_id="client-7")], "ingress")
        ledger.record([TokensCommitted(rid, (5,)), Finished(rid, Length(), 3, 1)], "ingress")
    assert [ledger.get(r)["client_request_id"] for r in ("cmpl-1", "cmpl-2")] == ["client-7", "client-7"]
    assert Ledger(journal=journal).get("cmpl-2")["client_request_id"] == "client-7"
    assert finish(ledger, "plain", (5,), Length())["client_request_id"] is None


def test_records_left_open_by_a_vanished_ingress_end_as_errors():
    ledger = Ledger()
    ledger.record([Arrived("lost", 3, 16)], "app/Ingress#dead")
    ledger.record([Arrived("kept", 3, 16)], "app/Ingress#alive")
    assert ledger.end_orphans({"app/Ingress#dead"}, "its ingress stopped answering") == 1
    lost, kept = ledger.get("lost"), ledger.get("kept")
    assert lost["status"] == "error" and lost["violations"] == [] and lost["completion_tokens"] == 0
    assert kept["status"] == "in_flight"
    assert ledger.summary()["by_status"]["in_flight"] == 1
    assert lost["stop_cause"]["kind"] == "error"


def test_a_migration_after_more_tokens_than_committed_is_a_violation():
    from pegaserve.ledger import Migrated

    ledger = Ledger()
    ledger.record([Arrived("m", 3, 16), Migrated("m", "app/Decode#1", 2, "ActorDiedError")], "ingress")
    ledger.record([TokensCommitted("m", (5, 6, 7)), Finished("m", Length(), 3, 3)], "ingress")
    assert ledger.get("m")["violations"] == [] and ledger.get("m")["migrations"][0]["num_tokens"] == 2
    ledger.record([Arrived("bad", 3, 16), Migrated("bad", "app/Decode#1", 9, "ActorDiedError")], "ingress")
    ledger.record([TokensCommitted("bad", (5,)), Finished("bad", Length(), 3, 1)], "ingress")
    assert ledger.get("bad")["violations"]


def test_internal_records_are_counted_apart_also_after_a_restart(tmp_path):
    journal = tmp_path / "ledger.jsonl"
    ledger = Ledger(journal=journal)
    finish(ledger, "client", (5, 17), Token(17))
    ledger.record([Arrived("step", 3, 1, internal=True), TokensCommitted("step", (9,)),
                   Finished("step", Length(), 3, 1)], "ingress")
    for summary in (ledger.summary(), Ledger(journal=journal).summary()):
        assert summary["by_status"]["finished"] == 1 and summary["by_stop_cause"] == {"token": 1}
        assert summary["internal_requests"] == 1 and summary["invariant_violations"] == 0
    assert ledger.get("step")["internal"] and not ledger.get("client")["internal"]


def test_an_event_after_an_internal_records_finish_lands_on_that_record():
    """Prefill's buffered events can reach the ledger after the ingress's finish (sent at once): a beam
    step's record stays finished and takes them, as a client's record does."""
    ledger = Ledger()
    ledger.record([Arrived("step", 3, 1, internal=True), TokensCommitted("step", (9,)),
                   Finished("step", Length(), 3, 1)], "ingress")
    ledger.record([Prefilled("step", 9, -0.5, "prefill#1")], "prefill")
    record = ledger.get("step")
    assert record["status"] == "finished" and record["first_token"] == {"id": 9, "logprob": -0.5}
    assert record["violations"] == [] and ledger.summary()["by_status"]["in_flight"] == 0
    ledger.record([Finished("step", Length(), 3, 1)], "ingress")
    assert ledger.get("step")["violations"] == ["more than one terminal event"]


def test_internal_records_push_out_no_clients_record(tmp_path):
    """A wide beam search makes many one-token internal records: they keep to a window of their own."""
    journal = tmp_path / "ledger.jsonl"
    ledger = Ledger(max_records=20, journal=journal)
    for i in range(5):
        finish(ledger, f"client-{i}", (5, 17), Token(17))
    for i in range(100):
        ledger.record([Arrived(f"step-{i}", 3, 1, internal=True), TokensCommitted(f"step-{i}", (9,)),
                       Finished(f"step-{i}", Length(), 3, 1)], "ingress")
    for restarted in (ledger, Ledger(max_records=20, journal=journal)):
        assert all(restarted.get(f"client-{i}")["status"] == "finished" for i in range(5))
        assert restarted.get("step-99")["internal"] and restarted.get("step-98") is not None
        assert restarted.get("step-97") is None  # the internal window keeps max_records // 10
        summary = restarted.summary()
        assert summary["num_records"] == 5 + 2 and summary["by_status"]["finished"] == 5
    assert ledger.summary()["internal_requests"] == 100
