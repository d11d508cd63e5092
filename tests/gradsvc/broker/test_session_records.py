"""Training sessions' records in a real Redis: an owner's live sessions (expired ones leave the owner's set), another
owner reads none, a delete takes the checkpoint with it, every write refreshes the session's TTL; and
checkpoint_every's default from the state's size."""

from __future__ import annotations

import msgspec

from gradsvc import wire
from gradsvc.broker import keys
from gradsvc.broker.session_records import SessionRecords, new_record
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
    assert flushed_redis.smembers(keys.training_sessions_key("t", "alice")) == {b"a1"}
    records.delete("alice", "a1")
    assert records.state("a1") is None and records.live("alice") == {}


def test_every_write_refreshes_the_ttl_of_the_record_and_its_checkpoint(flushed_redis):
    records = SessionRecords(flushed_redis, "t", ttl_s=60)
    records.put("s", new_record("alice", CREATE), b"state")
    flushed_redis.expire(keys.training_session_state_key("t", "s"), 5)
    records.put("s", records.get("s"))
    assert flushed_redis.ttl(keys.training_session_state_key("t", "s")) > 5
    assert flushed_redis.ttl(keys.training_session_key("t", "s")) > 5


def test_checkpoint_every_defaults_to_one_checkpoint_per_16_mib_of_state():
    assert default_checkpoint_every(1000) == 1
    assert default_checkpoint_every(16 << 20) == 1
    assert default_checkpoint_every(278_000_000) == 17
    assert default_checkpoint_every(10 << 30) == CHECKPOINT_EVERY_MAX
