"""The per-owner index of recent jobs (service/recent.py): newest first, one owner's only, bounded."""

from __future__ import annotations

import fakeredis

from gradsvc.broker import keys
from service import recent


async def test_the_index_keeps_each_owners_newest_jobs_only_and_expires():
    server = fakeredis.FakeServer()
    sync, aredis = fakeredis.FakeRedis(server=server), fakeredis.FakeAsyncRedis(server=server)
    for i in range(recent.RECENT_JOBS + 5):
        pipe = sync.pipeline()
        recent.record(pipe, "p", "alice", f"job-{i}", ttl_s=60)
        pipe.execute()
    pipe = sync.pipeline()
    recent.record(pipe, "p", "bob", "bobs-job", ttl_s=60)
    pipe.execute()
    ids = await recent.recent(aredis, "p", "alice")
    assert len(ids) == recent.RECENT_JOBS and ids[0] == f"job-{recent.RECENT_JOBS + 4}" and "job-4" not in ids
    assert "bobs-job" not in ids and await recent.recent(aredis, "p", "bob") == ["bobs-job"]
    assert 0 < sync.ttl(keys.owner_jobs_key("p", "alice")) <= 60
