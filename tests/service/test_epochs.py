"""Job ids and Redis's data epoch: ids of one Redis lifetime differ from their first characters, and an id
of an earlier epoch (whichever end carries it) reads as lost while one of the current epoch does not."""

from __future__ import annotations

import uuid

import pytest
from redis import Redis

from service.epochs import EPOCH_HEX, Epochs


@pytest.fixture()
def epochs(redis_server):
    redis = Redis.from_url(redis_server.url)
    redis.flushdb()
    yield Epochs(redis, "epochs-test")
    redis.close()


def test_job_ids_of_one_epoch_differ_from_their_first_characters_and_end_with_the_epoch(epochs):
    ids = [epochs.new_job_id() for _ in range(50)]
    assert len({i[:8] for i in ids}) == 50
    assert {i.replace("-", "")[-EPOCH_HEX:] for i in ids} == {epochs.current}
    assert {uuid.UUID(i).version for i in ids} == {4}


def test_an_id_of_an_earlier_epoch_reads_as_lost_and_one_of_the_current_epoch_does_not(epochs):
    old = epochs.new_job_id()
    old_style = str(uuid.UUID(hex=epochs.current + uuid.uuid4().hex[EPOCH_HEX:]))  # the epoch first
    epochs.redis.delete(epochs.key)  # Redis restarted empty: the next reader starts a new epoch
    epochs.refresh()
    assert epochs.is_lost(old) and epochs.is_lost(old_style)
    assert not epochs.is_lost(epochs.new_job_id())
    assert not epochs.is_lost(str(uuid.uuid4()))  # an id this service never issued: unknown, not lost
