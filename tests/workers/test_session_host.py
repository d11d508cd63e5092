"""The sessions one worker holds (workers/session_host.py) against a real Redis: a worker full of sessions it still
holds refuses one more with a coded workers_full (503) that says what to do; sessions whose record expired or moved
to another worker make room, and the idle sweep drops them whether or not room is needed; the session_resumed
refusal counts the passes it lost and commits its record over the one it read."""

from __future__ import annotations

import msgspec
import pytest

from gradsvc import wire
from gradsvc.broker import keys
from gradsvc.broker.session_records import SessionRecords, new_record
from gradsvc.engine import ComputeError
from workers.session_host import SessionHost

CREATE = msgspec.convert({"model": {"layers": [{"type": "Linear", "in_features": 2, "out_features": 1}]},
                          "optimizer": {"type": "sgd"}}, wire.SessionCreate)


def _hold(host: SessionHost, records: SessionRecords, session_id: str, holder: str) -> None:
    rec = new_record("alice", CREATE)
    rec.holder = holder
    records.put(session_id, rec)
    host.sessions[session_id] = object()  # room_for reads the records alone


def test_a_full_worker_refuses_one_more_session_until_one_expires_or_moves(flushed_redis):
    records = SessionRecords(flushed_redis, "t", ttl_s=60, worker="w1")
    host = SessionHost(max_sessions=2)
    _hold(host, records, "a", "w1")
    _hold(host, records, "b", "w1")
    host.room_for("a", records)  # one it holds already needs no room
    with pytest.raises(ComputeError) as err:
        host.room_for("c", records)
    assert err.value.code == "workers_full" and wire.ERROR_CODES["workers_full"].status == 503
    assert "GRADSVC_SESSION_MAX_PER_WORKER=2" in err.value.message and "DELETE /sessions/{id}" in err.value.message
    assert set(host.sessions) == {"a", "b"}
    moved = records.get("b")
    moved.holder = "w2"  # another worker took it over (this one was thought gone)
    records.put("b", moved)
    host.room_for("c", records)
    assert set(host.sessions) == {"a"}
    _hold(host, records, "c", "w1")
    flushed_redis.delete(keys.training_session_key("t", "a"))  # expired (GRADSVC_SESSION_IDLE_TTL_S)
    host.room_for("d", records)
    assert set(host.sessions) == {"c"}


def test_the_sweep_drops_the_sessions_deleted_expired_or_held_elsewhere_and_keeps_the_others(flushed_redis):
    records = SessionRecords(flushed_redis, "t", ttl_s=60, worker="w1")
    host = SessionHost(max_sessions=16)
    for session_id, holder in (("live", "w1"), ("moved", "w2"), ("deleted", "w1"), ("expired", "w1")):
        _hold(host, records, session_id, holder)
    records.delete("alice", "deleted")
    flushed_redis.delete(keys.training_session_key("t", "expired"))
    assert host.sweep(records) == 3 and set(host.sessions) == {"live"}
    assert host.sweep(records) == 0 and SessionHost(4).sweep(records) == 0


def test_the_resumed_refusal_counts_the_accumulated_passes_lost_and_is_committed_over_the_record_read(flushed_redis):
    """The 409 session_resumed message read the accumulated passes after resetting them (it always said 0); and
    its record write is a commit like a step's: over a record changed since, it writes nothing."""
    from types import SimpleNamespace

    from workers.session_jobs import Call, _refuse_lost_steps

    records = SessionRecords(flushed_redis, "t", ttl_s=60, worker="w2")
    rec = new_record("alice", CREATE)
    rec.holder, rec.step, rec.accumulated = "w1", 5, 2
    records.put("s", rec)
    host = SessionHost(max_sessions=4)
    restored = SimpleNamespace(step=4, accumulated=0, device="cpu")  # its checkpoint's: step 4
    call = Call(job=None, ctx=SimpleNamespace(sessions=host), records=records, session_id="s", body=b"",
                fmt="json", started=0.0)
    read = call.record()
    with pytest.raises(Exception) as err:
        _refuse_lost_steps(call, read, restored)
    assert err.value.code == "session_resumed" and "the 1 optimizer steps after it (and 2 accumulated passes)" in \
        err.value.message
    assert (records.get("s").step, records.get("s").holder) == (4, "w2")
    call.record()
    changed = records.get("s")
    changed.last_used_at += 1  # another worker's commit since the read
    records.put("s", changed)
    with pytest.raises(Exception) as err:
        _refuse_lost_steps(call, call.records.get("s"), restored)
    assert err.value.code == "session_conflict"
