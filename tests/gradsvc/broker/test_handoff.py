"""gradsvc/broker/handoff.py alone (no Redis): the domain, files by ref, hostile refs, the sweep, the result marker;
the routing names in gradsvc/broker/keys.py; `gradsvc up`'s per-stack dir."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading
import time

import msgspec
import pytest

from gradsvc.broker import handoff as hf
from gradsvc.broker import keys
from gradsvc.broker.handoff import Handoff, HandoffError
from gradsvc.runtime.launcher import claim_handoff_dir, handoff_dir
from gradsvc.runtime.settings import Settings, SettingsError
from gradsvc.wire import GradientResult, Timings


def test_the_domain_is_made_once_and_racers_share_it(tmp_path):
    d = tmp_path / "h"
    got: list[str] = []
    barrier = threading.Barrier(8)

    def make() -> None:
        barrier.wait()
        got.append(Handoff(d).domain)

    threads = [threading.Thread(target=make) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8  # no racer refused the dir as it was being made
    assert len(set(got)) == 1 and len(got[0]) == 32
    assert (d / "domain").read_text() == got[0]
    assert Handoff(d).domain == got[0]  # read, not made again
    assert sorted(os.listdir(d)) == ["domain"]  # no temp file left behind
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert stat.S_IMODE((d / "domain").stat().st_mode) == 0o600


def test_another_dir_is_another_domain(tmp_path):
    assert Handoff(tmp_path / "a").domain != Handoff(tmp_path / "b").domain


def test_put_get_take_delete(tmp_path):
    h = Handoff(tmp_path, min_bytes=10)
    data = os.urandom(3000)
    ref = h.put("0b5e3c1e-1d2f-4f7a-9a1b-2c3d4e5f6a7b", hf.INPUT, data)
    assert ref == f"{h.domain}/0b5e3c1e-1d2f-4f7a-9a1b-2c3d4e5f6a7b.in"
    path = tmp_path / "0b5e3c1e-1d2f-4f7a-9a1b-2c3d4e5f6a7b.in"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert h.get(ref) == data and h.get(ref) == data
    taken = h.take(ref)  # mapped: the file's pages, readable after the file is gone
    assert not path.exists() and taken[:] == data
    other = h.put("job-other", hf.INPUT, data)
    view = memoryview(h.take(other))
    view[:4] = b"gone"  # private and writable: a tensor written in place faults no worker (copy on write)
    assert bytes(view[:4]) == b"gone" and taken[:] == data
    assert h.get(ref) is None and h.take(ref) is None
    empty = h.put("job-empty", hf.INPUT, b"")
    assert h.take(empty) == b""
    ref = h.put("job-shard-1", hf.RESULT, memoryview(data))
    h.delete(ref)
    assert h.get(ref) is None
    h.delete(ref)  # deleting what is gone is fine
    for kind in hf.KINDS:
        h.put("job-shard-2", kind, b"x")
    h.discard("job-shard-2")
    assert sorted(os.listdir(tmp_path)) == ["domain"]
    assert h.wanted(10) and not h.wanted(9)


def test_drop_deletes_only_a_file_its_marker_names_in_this_dir(tmp_path):
    h, elsewhere = Handoff(tmp_path / "here"), Handoff(tmp_path / "there")
    mine, theirs = h.put("job-drop-1", hf.RESULT, b"x"), elsewhere.put("job-drop-2", hf.RESULT, b"y")
    assert not hf.drop(b"plain result bytes", h) and not hf.drop(None, h) and not hf.drop(h.marker(mine), None)
    assert not hf.drop(h.marker(theirs), h) and elsewhere.get(theirs) == b"y"  # another domain's: its own sweep
    assert hf.drop(h.marker(mine), h) and h.get(mine) is None


def test_a_released_file_is_recycled_into_the_spare_unless_someone_reads_it(tmp_path):
    h = Handoff(tmp_path, min_bytes=10)
    spare, data, body = hf.Spare(h), os.urandom(1 << 20), os.urandom((1 << 20) + 5)
    ref = h.put("job-recycled", hf.RESULT, data)
    inode = (tmp_path / "job-recycled.out").stat().st_ino
    spare.prepare(1 << 20)  # a spare held already: the recycled file takes its place
    assert hf.drop(h.marker(ref), h, spare) and h.get(ref) is None
    assert [n for n in os.listdir(tmp_path) if n != "domain"] == [spare._path.name]
    assert spare._path.stat().st_ino == inode  # the result's own pages, kept
    next_ref = h.stage(body, spare, refill=False).commit("job-next", hf.INPUT)
    assert (tmp_path / "job-next.in").stat().st_ino == inode and spare._path is None  # written over; not made again
    assert h.take(next_ref)[:] == body  # cut to the body's size

    ref = h.put("job-read", hf.RESULT, data)  # a result being sent: its map holds the file's lock
    sending = h.map(ref)
    assert not hf.drop(h.marker(ref), h, spare) and h.get(ref) is None and spare._path is None
    assert sending[:] == data  # deleted, not written over: the reader keeps its pages

    ref = h.put("job-late", hf.RESULT, data)  # a reader that opened the file just before it was recycled
    path = tmp_path / "job-late.out"
    holder = os.open(path, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)  # where recycle holds its lock
    got: list = []
    reader = threading.Thread(target=lambda: got.append(h.map(ref)))
    reader.start()
    time.sleep(0.2)
    assert spare.keep(path)  # renamed under the lock, then the lock let go
    os.close(holder)
    reader.join(5)
    assert got == [None]  # the name no longer names the file it opened: gone, never the spare's next bytes
    spare.drop()
    after = tmp_path / "job-after.out"
    after.write_bytes(b"x")
    assert not spare.keep(after) and not after.exists()  # a dropped spare keeps nothing


def test_without_flock_a_released_file_is_only_deleted_and_reads_still_work(tmp_path, monkeypatch):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(hf.fcntl, "flock", no_locks)  # a filesystem without flock
    h = Handoff(tmp_path, min_bytes=10)
    spare = hf.Spare(h)
    ref = h.put("job-nolock", hf.RESULT, b"result")
    assert h.map(ref)[:] == b"result" and h.get(ref) == b"result"
    assert not hf.drop(h.marker(ref), h, spare) and h.get(ref) is None and spare._path is None


def test_a_staged_file_is_named_by_commit_or_dropped_by_discard(tmp_path):
    h = Handoff(tmp_path, min_bytes=10)
    data = os.urandom(1 << 20)
    ref = h.stage(data).commit("job-staged", hf.INPUT)
    assert ref == h.ref("job-staged", hf.INPUT) and h.take(ref)[:] == data
    staged = h.stage(data)
    staged.discard()
    staged.discard()  # twice is fine; and after commit, discard is a no-op
    kept = h.stage(b"kept")
    ref = kept.commit("job-kept", hf.INPUT)
    kept.discard()
    deadline = time.monotonic() + 5
    while len(os.listdir(tmp_path)) > 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(os.listdir(tmp_path)) == ["domain", "job-kept.in"]
    gone = Handoff(tmp_path / "gone", min_bytes=10)
    for name in os.listdir(gone.dir):
        os.unlink(gone.dir / name)
    os.rmdir(gone.dir)
    with pytest.raises(OSError):  # the write failed (here: no dir): commit raises it, nothing is left
        gone.stage(data).commit("job-x", hf.INPUT)


@pytest.mark.parametrize("ref", [
    "../x", "/etc/passwd", "{d}/../domain", "{d}//etc/passwd", "{d}/domain", "{d}/x.txt", "{d}/.tmp-x.in",
    "{d}/a/b.in", "{d}/", "{d}", "{d}/-x.in", "{d}/x.in\x00", "{d}/x.in/", "{d}/..in", "other/x.in",
    "0123456789abcdef0123456789abcdef/x.in", "{d}/" + "a" * 200 + ".in", "", "{d}/x.IN",
])
def test_hostile_or_foreign_refs_are_refused(tmp_path, ref):
    h = Handoff(tmp_path / "h")
    (tmp_path / "h" / "x.txt").write_text("secret")
    with pytest.raises(HandoffError):
        h.get(ref.format(d=h.domain))
    with pytest.raises(HandoffError):
        h.take(ref.format(d=h.domain))
    with pytest.raises(HandoffError):
        h.delete(ref.format(d=h.domain))
    assert (tmp_path / "h" / "x.txt").exists() and (tmp_path / "h" / "domain").exists()


def test_refs_that_are_not_strings_and_bad_names_are_refused(tmp_path):
    h = Handoff(tmp_path)
    for ref in (None, b"x", 5):
        with pytest.raises(HandoffError):
            h.get(ref)
    for job_id in ("../x", "a/b", "", ".x", "x y"):
        with pytest.raises(HandoffError):
            h.put(job_id, hf.INPUT, b"data")
    with pytest.raises(HandoffError):
        h.put("job", "exe", b"data")
    assert sorted(os.listdir(tmp_path)) == ["domain"]


def test_a_symlink_is_not_followed(tmp_path):
    h = Handoff(tmp_path / "h")
    (tmp_path / "secret").write_bytes(b"secret")
    os.symlink(tmp_path / "secret", tmp_path / "h" / "job.out")
    with pytest.raises(OSError):
        h.get(f"{h.domain}/job.out")


def test_a_result_is_mapped_for_sending_and_its_file_kept(tmp_path):
    h = Handoff(tmp_path, min_bytes=10)
    data = os.urandom(1 << 20)
    ref = h.put("job-mapped", hf.RESULT, data)
    mapped = hf.load(h.marker(ref), h, mapped=True)
    assert mapped[:] == data and h.map(ref)[:] == data and hf.load(h.marker(ref), h) == data
    mapped[:4] = b"mine"  # private: the file, and every later reader, keep what was put
    assert h.get(ref) == data and h.map(ref)[:] == data
    h.put("job-mapped", hf.RESULT, b"again")  # replaced whole: a map made before still reads the old bytes
    assert mapped[4:] == data[4:] and h.map(ref)[:] == b"again"
    h.delete(ref)
    assert h.map(ref) is None and hf.load(h.marker(ref), h, mapped=True) is None
    assert h.map(h.put("job-empty", hf.RESULT, b"")) == b""
    os.symlink(tmp_path / "domain", tmp_path / "job-link.out")
    with pytest.raises(OSError):
        h.map(h.ref("job-link", hf.RESULT))


def test_sweep_by_age_and_kind(tmp_path):
    h = Handoff(tmp_path)
    old, new = time.time() - 1000, time.time()
    for name, mtime in [("a.in", old), ("b.in", new), ("a.out", old), ("b.out", new), ("a.ref", old),
                        (".tmp-a.out-1234", old), (".tmp-b.out-1234", new), ("launcher.pid", old),
                        ("notes.txt", old)]:
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (mtime, mtime))
    assert h.sweep({"in": 2000, "out": 500, "ref": 500}) == 3  # a.out, a.ref, the old temp file
    assert sorted(os.listdir(tmp_path)) == [".tmp-b.out-1234", "a.in", "b.in", "b.out", "domain", "launcher.pid",
                                            "notes.txt"]
    assert h.sweep(10) == 1  # a.in
    assert not h.sweep_due()
    ages = hf.sweep_ages(3600, 86400)
    assert ages == {"in": 86400.0, "out": 3660.0, "ref": 3660.0}


def test_the_marker_is_no_messagepack_result_and_load_reads_either(tmp_path):
    h = Handoff(tmp_path)
    result = msgspec.msgpack.encode(GradientResult(device="cpu", dtype="float32", parameter_count=0,
                                                   torch_version="2", loss=1.0, gradients={},
                                                   timings=msgspec.convert({}, Timings)))
    assert not hf.is_marker(result) and hf.load(result, h) == result and hf.load(result, None) == result
    assert hf.load(None, h) is None
    ref = h.put("job", hf.RESULT, result)
    marker = h.marker(ref)
    assert hf.is_marker(marker) and len(marker) < 100
    with pytest.raises(msgspec.DecodeError):
        msgspec.msgpack.decode(marker)
    assert hf.load(marker, h) == result
    with pytest.raises(HandoffError):
        hf.load(marker, None)  # handoff off here
    with pytest.raises(HandoffError):
        hf.load(marker, Handoff(tmp_path / "other"))  # another domain
    h.delete(ref)
    assert hf.load(marker, h) is None  # expired


def test_domain_queues_come_first_and_are_named_in_keys():
    assert keys.worker_queues("gradsvc", "cpu") == ["gradsvc-cpu", "gradsvc"]
    assert keys.worker_queues("gradsvc", "cuda", "d0") == ["gradsvc-cuda@d0", "gradsvc@d0", "gradsvc-cuda", "gradsvc"]
    assert keys.in_domain("gradsvc-cpu@d0", "d0") and not keys.in_domain("gradsvc-cpu", "d0")
    assert not keys.in_domain(None, "d0") and not keys.in_domain("gradsvc@d1", "d0")
    assert keys.rq_queue_workers_key("gradsvc@d0") == "rq:workers:gradsvc@d0"


def test_settings():
    s = Settings.from_env({})
    assert s.handoff_dir == "" and s.handoff_min_bytes == 1 << 20
    s = Settings.from_env({"GRADSVC_HANDOFF_DIR": "/dev/shm/x", "GRADSVC_HANDOFF_MIN_BYTES": "0"})
    assert s.handoff_dir == "/dev/shm/x" and s.handoff_min_bytes == 0
    with pytest.raises(SettingsError, match="GRADSVC_HANDOFF_MIN_BYTES"):
        Settings.from_env({"GRADSVC_HANDOFF_MIN_BYTES": "-1"})
    assert hf.open_dir("", 5) is None


def test_up_makes_one_dir_per_port_and_claims_it(tmp_path):
    path = handoff_dir(8123)
    assert path.name == "gradsvc-8123" and path.parent.is_dir()
    d = tmp_path / "gradsvc-1"
    d.mkdir()
    (d / "left.out").write_bytes(b"x")
    (d / "launcher.pid").write_text("999999999")  # a launcher that is gone
    assert claim_handoff_dir(d)
    assert sorted(os.listdir(d)) == ["launcher.pid"] and stat.S_IMODE(d.stat().st_mode) == 0o700
    (d / "launcher.pid").write_text(str(os.getppid()))  # a live one
    (d / "kept.out").write_bytes(b"x")
    assert not claim_handoff_dir(d)
    assert (d / "kept.out").exists()


def test_the_launchers_pid_file_is_mode_0600_as_the_dirs_other_files(tmp_path):
    """launcher.pid is 0600 like every file of the dir (docs/large-models.md), not 0644 (the umask's)."""
    from gradsvc.runtime.launcher import OWNER_FILE, claim_handoff_dir

    old = os.umask(0o022)
    try:
        assert claim_handoff_dir(tmp_path / "gradsvc-1")
    finally:
        os.umask(old)
    pid_file = tmp_path / "gradsvc-1" / OWNER_FILE
    assert stat.S_IMODE(pid_file.stat().st_mode) == 0o600 and pid_file.read_text() == str(os.getpid())
    assert stat.S_IMODE((tmp_path / "gradsvc-1").stat().st_mode) == 0o700


def test_a_result_goes_into_the_spare_file_once_and_the_spare_is_safe_to_lose(tmp_path):
    h = Handoff(tmp_path / "h")
    spare = hf.Spare(h)
    data = os.urandom(3 << 20)
    spare.prepare(len(data) + 4096)  # larger than the result: the file is cut to the result's size
    (kept,) = [p for p in (tmp_path / "h").iterdir() if p.name.startswith(".spare-")]
    assert kept.stat().st_size == len(data) + 4096 and kept.stat().st_blocks * 512 >= len(data)  # allocated
    ref = h.put("job1", hf.RESULT, data, spare=spare)
    assert not kept.exists() and h.get(ref) == data and h.path(ref).stat().st_size == len(data)
    assert stat.S_IMODE(h.path(ref).stat().st_mode) == 0o600
    # no spare now: the next result makes a file of its own, as it did before spares
    ref2 = h.put("job2", hf.RESULT, b"x" * 10, spare=spare)
    assert h.get(ref2) == b"x" * 10
    # a spare the sweep took (idle past TMP_MAX_AGE_S) costs nothing but its pages
    spare.prepare(100)
    (kept,) = [p for p in (tmp_path / "h").iterdir() if p.name.startswith(".spare-")]
    os.utime(kept, (time.time() - hf.TMP_MAX_AGE_S - 5,) * 2)
    assert h.sweep(600) == 1 and not kept.exists()
    ref3 = h.put("job3", hf.RESULT, b"y" * 50, spare=spare)
    assert h.get(ref3) == b"y" * 50
    assert sorted(p.name for p in (tmp_path / "h").iterdir() if p.name != "domain") == [
        "job1.out", "job2.out", "job3.out"]
    # prepare keeps one spare at most; drop deletes it
    spare.prepare(10)
    spare.prepare(10)
    assert len([p for p in (tmp_path / "h").iterdir() if p.name.startswith(".spare-")]) == 1
    spare.drop()
    assert not [p for p in (tmp_path / "h").iterdir() if p.name.startswith((".tmp-", ".spare-"))]


def test_a_spare_on_a_full_tmpfs_is_skipped(tmp_path):
    h = Handoff(tmp_path / "h")
    spare = hf.Spare(h)
    spare.prepare(1 << 60)  # more than any disk: fallocate fails, nothing is left behind
    assert spare.take() is None
    assert not [p for p in (tmp_path / "h").iterdir() if p.name.startswith((".tmp-", ".spare-"))]


def test_a_staged_body_goes_into_the_spare_and_commit_makes_the_next_one(tmp_path):
    """The API's large bodies (Enqueuer.start): staged into the spare's pages, a spare of the body's size made
    again once committed, none when the body is discarded (the spare it took became that body's file)."""
    h = Handoff(tmp_path / "h")
    spare = hf.Spare(h)
    data = os.urandom(2 << 20)
    spare.prepare(len(data))
    (kept,) = [p for p in (tmp_path / "h").iterdir() if p.name.startswith(".spare-")]
    ref = h.stage(data, spare).commit("job-a", hf.INPUT)
    assert not kept.exists() and h.path(ref).stat().st_size == len(data) and h.take(ref)[:] == data
    for _ in range(100):  # the prepare runs on the writers' thread: done once the spare keeps its file (its
        if spare._path is not None:  # name appears before posix_fallocate has sized it)
            break
        time.sleep(0.02)
    made = [p for p in (tmp_path / "h").iterdir() if p.name.startswith(".spare-")]
    assert made == [spare._path] and made[0].stat().st_size == len(data)
    staged = h.stage(b"z" * 100, spare)
    staged.discard()
    staged.written.result()
    time.sleep(0.05)
    assert not [p for p in (tmp_path / "h").iterdir() if p.name.startswith((".tmp-", ".spare-"))]
    # with no spare kept, staging writes a file of its own
    ref = h.stage(b"w" * 10, spare).commit("job-b", hf.INPUT)
    assert h.take(ref)[:] == b"w" * 10


def test_a_prepare_after_drop_keeps_nothing(tmp_path):
    """drop() at the process's exit, with a prepare still queued behind it: that prepare makes no file."""
    h = Handoff(tmp_path / "h")
    spare = hf.Spare(h)
    spare.drop()
    spare.prepare(4096)
    assert spare.take() is None
    assert not [p for p in (tmp_path / "h").iterdir() if p.name.startswith((".tmp-", ".spare-"))]


def test_a_dir_holding_an_operators_files_is_refused_and_none_of_them_is_touched(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o755)
    for name, age_s in (("run-2024.out", 3 * 3600), ("notes.in", 3 * 86400), ("plot.png", 60)):
        (shared / name).write_bytes(b"mine")
        os.utime(shared / name, (time.time() - age_s, time.time() - age_s))
    with pytest.raises(HandoffError) as refused:
        Handoff(shared)
    message = str(refused.value)
    assert "GRADSVC_HANDOFF_DIR" in message and "notes.in, plot.png, run-2024.out" in message
    assert "new or empty directory" in message
    assert sorted(os.listdir(shared)) == ["notes.in", "plot.png", "run-2024.out"]
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755


def test_an_empty_dir_is_adopted_0700_and_the_services_own_dir_is_taken_again(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    os.chmod(empty, 0o755)
    first = Handoff(empty)
    assert stat.S_IMODE(empty.stat().st_mode) == 0o700
    first.put("job-1", hf.RESULT, b"result")
    os.chmod(empty, 0o755)
    again = Handoff(empty)  # its domain file says it is the service's own: its files are the service's
    assert again.domain == first.domain and again.get(first.ref("job-1", hf.RESULT)) == b"result"
    assert stat.S_IMODE(empty.stat().st_mode) == 0o700
