"""Training sessions' records in a real Redis: an owner's live sessions (expired ones leave the owner's set), another
owner reads none, a delete takes the checkpoint with it, every write refreshes the session's TTL; admission counts
and sums the live sessions in one step, so concurrent ones at the limit cannot all get in; and checkpoint_every's
default from the state's size."""

from __future__ import annotations

import threading

import msgspec

from gradsvc import wire
from gradsvc.broker import keys
from gradsvc.broker.session_records import (ADMITTED, CHANGED, COMMITTED, GONE, OVER_BUDGET, TOO_MANY,
                                            SessionRecords, new_record)
from workers.session_host import CHECKPOINT_EVERY_MAX, default_checkpoint_every

CREATE = msgspec.convert({"model": {"layers": [{"type": "Linear", "in_features": 2, "out_features": 1}],
                                    "weights": {"0.bias": {"dtype": "float32", "shape": [1], "data": [0.5]}}}, "optimizer": {"type": "sgd"}}, wire.SessionCreate)


def test_live_sessions_are_the_owners_own_and_an_expired_one_leaves_the_set(flushed_redis):
    records = SessionRecords(flushed_redis, "t", ttl_s=60)
    records.put("a1", new_record("alice", CREATE), b"state")
    records.put("a2", new_record("alice", CREATE))
    records.put("b1", new_record("bob", CREATE))
    assert sorted(records.live("alice")) == ["a1", "a2"]
    assert records.owned("bob", "a1") is None and records.owned("alice", "a1").owner == "alice"
    assert records.get("a1").create.model.weights is None  # the weights live in the checkpoint alone
    flushed_redis.delete(keys.training_session_key("t", "a2"))  # as its TTL would
    assert list(records.live("alice")) == ["a1"]
    assert flushed_redis.hkeys(keys.training_sessions_key("t", "alice")) == [b"a1"]
    records.delete("alice", "a1")
    assert records.state("a1") is None and records.live("alice") == {}


def test_every_commit_refreshes_the_ttl_of_the_record_its_checkpoint_and_its_answers(flushed_redis):
    records = SessionRecords(flushed_redis, "t", ttl_s=60)
    records.put("s", new_record("alice", CREATE), b"state")
    rec, read = records.read("s")
    assert records.commit("s", read, rec, answer=("key-1", b"answer")) == COMMITTED
    for key in (keys.training_session_state_key("t", "s"), keys.training_session_answers_key("t", "s")):
        flushed_redis.expire(key, 5)
    rec, read = records.read("s")
    assert records.commit("s", read, rec) == COMMITTED
    for key in ("s", "s:state", "s:answers"):
        assert flushed_redis.ttl(f"t:tsession:{key}") > 5, key
    assert records.answer("s", "key-1") == b"answer"


def test_a_commit_writes_only_over_the_record_it_read_and_never_brings_a_deleted_session_back(flushed_redis):
    records = SessionRecords(flushed_redis, "t", ttl_s=60)
    records.put("s", new_record("alice", CREATE), b"state-0")
    rec, read = records.read("s")
    first, second = msgspec.structs.replace(rec, step=1), msgspec.structs.replace(rec, step=1, holder="other")
    assert records.commit("s", read, first, b"state-1", ("k1", b"a1")) == COMMITTED
    assert records.commit("s", read, second, b"state-x", ("k2", b"a2")) == CHANGED  # the other restorer
    assert records.get("s").holder == "" and records.state("s") == b"state-1" and records.answer("s", "k2") is None
    rec, read = records.read("s")
    assert records.commit("s", read, rec, answer=("k3", b"a3"), forgotten=("k1",)) == COMMITTED
    assert records.answer("s", "k1") is None and records.answer("s", "k3") == b"a3"  # forgotten with its key
    records.delete("alice", "s")
    assert records.commit("s", read, rec, b"state-2", ("k4", b"a4")) == GONE
    assert [k for k in flushed_redis.scan_iter("t:tsession:s*")] == [] and records.live("alice") == {}


def test_checkpoint_every_defaults_to_one_checkpoint_per_16_mib_of_state():
    assert default_checkpoint_every(1000) == 1
    assert default_checkpoint_every(16 << 20) == 1
    assert default_checkpoint_every(278_000_000) == 17
    assert default_checkpoint_every(10 << 30) == CHECKPOINT_EVERY_MAX


def _record(owner: str, state_bytes: int):
    rec = new_record(owner, CREATE)
    rec.state_bytes = state_bytes
    return rec


def test_admission_counts_the_live_sessions_and_their_bytes_and_writes_the_record_only_within_both(flushed_redis):
    records = SessionRecords(flushed_redis, "t", ttl_s=60)
    assert records.admit("alice", "a1", _record("alice", 100), limit=2, budget_bytes=250) == (ADMITTED, [], 0)
    assert records.admit("alice", "a2", _record("alice", 200), limit=2, budget_bytes=250) == (OVER_BUDGET, ["a1"], 100)
    assert records.get("a2") is None
    assert records.admit("alice", "a2", _record("alice", 150), limit=2, budget_bytes=250) == (ADMITTED, ["a1"], 100)
    assert records.admit("alice", "a3", _record("alice", 1), limit=2, budget_bytes=10**12)[:2] == (TOO_MANY,
                                                                                                 ["a1", "a2"])
    assert records.admit("bob", "b1", _record("bob", 1), limit=2, budget_bytes=250)[0] == ADMITTED  # per owner
    flushed_redis.delete(keys.training_session_key("t", "a1"))  # expired: it leaves the count and the bytes
    assert records.admit("alice", "a3", _record("alice", 100), limit=2, budget_bytes=250) == (ADMITTED, ["a2"], 150)
    assert sorted(records.live("alice")) == ["a2", "a3"]
    grown, read = records.read("a2")
    grown.state_bytes = 10**13  # its worker's commit says what it holds now
    assert records.commit("a2", read, grown) == COMMITTED
    assert records.admit("alice", "a4", _record("alice", 1), limit=9, budget_bytes=10**12)[0] == OVER_BUDGET


def test_concurrent_admissions_at_the_limit_let_exactly_the_room_in(flushed_redis):
    records = SessionRecords(flushed_redis, "t", ttl_s=60)
    records.admit("alice", "held", _record("alice", 1), limit=3, budget_bytes=100)
    start, verdicts = threading.Barrier(12), []

    def create(i: int) -> None:
        start.wait()
        verdicts.append(records.admit("alice", f"new{i}", _record("alice", 1), limit=3, budget_bytes=100)[0])

    threads = [threading.Thread(target=create, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(verdicts) == [ADMITTED] * 2 + [TOO_MANY] * 10
    assert len(records.live("alice")) == 3
