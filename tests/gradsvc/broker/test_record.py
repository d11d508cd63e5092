"""The job record's typed fields read what the API and the workers write, in RQ's stored form."""

from __future__ import annotations

import fakeredis
from rq.job import Job

from gradsvc.broker.job import MsgpackSerializer
from gradsvc.broker.record import JobMeta, ShardPlace, write_error, write_progress


def _job(meta: dict) -> Job:
    job = Job.create("workers.jobs.gradient_job", args=(b"",), connection=fakeredis.FakeRedis(),
                     serializer=MsgpackSerializer, meta=meta)
    job.save()
    return job


def test_a_shard_s_owner_is_read_from_its_place():
    meta = JobMeta(shard=ShardPlace(parent="p", index=1, count=2, rows=[3, 5], owner="key-a")).as_meta()
    assert JobMeta.of(meta).job_owner == "key-a" and JobMeta.of(meta).shard.rows == [3, 5]
    assert JobMeta.of({}).job_owner == "anonymous"


def test_errors_and_progress_written_by_a_worker_read_back_typed_from_redis():
    job = _job(JobMeta(owner="key-a").as_meta())
    write_progress(job, "numcheck", 3, 10)
    write_error(job, "canceled", "canceled by POST /jobs/{id}/cancel before it started")
    stored = JobMeta.of(Job.fetch(job.id, connection=job.connection, serializer=MsgpackSerializer).meta)
    assert stored.owner == "key-a" and stored.is_canceled
    assert (stored.progress.phase, stored.progress.done, stored.progress.total) == ("numcheck", 3, 10)
    assert stored.error.detail == {}


def test_the_stored_form_is_the_plain_map_older_apis_wrote():
    """Jobs enqueued before the fields were typed read the same."""
    old = {"owner": "key-a", "error": {"code": "timeout", "message": "m", "detail": {"hard_stop": True}}}
    meta = JobMeta.of(old)
    assert meta.as_meta() == old and meta.error.code == "timeout" and not meta.is_canceled
