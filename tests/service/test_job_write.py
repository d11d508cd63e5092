"""service/job_write.py's template of a plain job's commands, against RQ's own enqueue on a real Redis: the record
it writes is RQ's field for field (its timestamps aside), the job is queued and indexed as RQ's is, RQ reads it
back as the job it enqueued, and an RQ that writes something per job the template does not fill in gets no
template (the enqueue then goes through RQ)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio
from rq.job import Job

from gradsvc.broker import keys
from gradsvc.broker.connection import send_async
from gradsvc.broker.job import GRADIENT_JOB, GradientJob, MsgpackSerializer
from gradsvc.runtime.settings import Settings
from service.app import job_parts
from service.enqueue import JobRequest
from service.job_write import JobTemplate

_STAMPS = {b"created_at", b"enqueued_at"}


@pytest.fixture()
def parts(flushed_redis, redis_server):
    store = job_parts(Settings(redis_url=redis_server.url))
    yield store
    store.queues.redis.close()


def _by_rq(parts, job: JobRequest, job_id: str) -> None:
    with parts.queues.redis.pipeline() as pipe:
        parts.enqueuer._enqueue_plain(pipe, parts.queues.shared["auto"], job.body, job, job_id)
        pipe.execute()


def _by_template(parts, url: str, job: JobRequest, job_id: str) -> None:
    async def send():  # a client of this loop's own (each asyncio.run is another loop)
        client = redis.asyncio.from_url(url)
        try:
            await send_async(client, parts.enqueuer.plain_commands(job, job_id), transaction=True)
        finally:
            await client.aclose()

    asyncio.run(send())


@pytest.mark.parametrize("body, fmt", [(b'{"model": {}}', "json"), (b"\x81\xa5model\x80", "msgpack")])
def test_the_templates_record_is_rqs_own_and_rq_reads_it_back(parts, redis_server, flushed_redis, body, fmt):
    assert parts.enqueuer.plain_commands(JobRequest(b"{}", "json", "x"), "warm")  # the template is made at first use
    assert isinstance(parts.enqueuer._template, JobTemplate)
    r, queue = flushed_redis, parts.queues.shared["auto"]
    ids = {way: str(uuid.uuid4()) for way in ("rq", "template")}
    job = JobRequest(body, fmt, "owner-\u00e9")
    _by_rq(parts, job, ids["rq"])
    _by_template(parts, redis_server.url, job, ids["template"])
    rq_rec, ours = (r.hgetall(Job.key_for(ids[w])) for w in ("rq", "template"))
    assert {k: v for k, v in ours.items() if k not in _STAMPS} == {k: v for k, v in rq_rec.items() if k not in _STAMPS}
    assert ours.keys() == rq_rec.keys() and ours[b"created_at"] == ours[b"enqueued_at"]
    assert r.lrange(queue.key, 0, -1) == [ids["rq"].encode(), ids["template"].encode()]
    assert queue.key.encode() in r.smembers("rq:queues")
    index = r.zrange(keys.owner_jobs_key(parts.enqueuer.record.prefix, job.owner), 0, -1)
    assert index == [ids["rq"].encode(), ids["template"].encode()]
    read = GradientJob.fetch(ids["template"], connection=parts.queues.redis, serializer=MsgpackSerializer)
    assert (read.func_name, read.args, read.meta["owner"], read.get_status().value, read.timeout) == \
        (GRADIENT_JOB, [body, fmt], job.owner, "queued", parts.enqueuer.record.timeout_s)
    assert read.enqueued_at is not None and read.created_at is not None


def test_an_rq_that_writes_more_per_job_makes_no_template_and_the_enqueue_goes_through_rq(parts, redis_server,
                                                                                        flushed_redis, monkeypatch):
    plain = GradientJob.to_dict

    def with_a_nonce(self, *args, **kwargs):
        return {**plain(self, *args, **kwargs), "nonce": uuid.uuid4().hex}

    monkeypatch.setattr(GradientJob, "to_dict", with_a_nonce)
    record = parts.enqueuer.record
    assert JobTemplate.of(parts.queues.shared["auto"], record.timeout_s, record.result_ttl_s,
                          record.failure_ttl_s) is None
    job_id = str(uuid.uuid4())
    _by_template(parts, redis_server.url, JobRequest(b"{}", "json", "me"), job_id)
    assert parts.enqueuer._template is None
    assert flushed_redis.hget(Job.key_for(job_id), "nonce")  # RQ's own record, as this RQ writes it
