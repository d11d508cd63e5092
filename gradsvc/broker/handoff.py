"""Large payloads handed over outside Redis when the API and the workers share a host (GRADSVC_HANDOFF_DIR).

A job's body, or a result, of at least GRADSVC_HANDOFF_MIN_BYTES goes to a file in the handoff dir (a
tmpfs: /dev/shm under `gradsvc up`) and Redis carries only its reference: the job's argument is the ref
(a str, which MessagePack keeps apart from the bytes of a body), a result key holds a small marker with
the ref, under the same TTL as a result stored inline. Redis copies large values at 0.5-1 GB/s and each
of them crossed it twice (in, out); a file on tmpfs is written once and read once.

The domain: the dir holds a file `domain` with a random id, created once (first writer wins, atomically).
Processes that read the same id see the same files: the same host and the same tmpfs. A process on
another machine (or in another container) with the same path reads another id, so it never gets a ref
it could not open: the API hands a job off only through its domain's queues, which only workers of the
domain drain (gradsvc.broker.keys.worker_queues).

A ref is "<domain>/<name>", name a job or shard id and a kind (.in: a job's body, .out: a result, .ref: a
shard's float64 reference). Refs come out of Redis, so none is opened as it is: the domain must be this
dir's and the name must match a strict pattern; the path is this process's own dir joined with that name.

No Redis and no torch here: os, uuid and pathlib only.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger("gradsvc.handoff")
# Kinds of file, by suffix: a job's (or shard's) body, a result, a shard's float64 reference gradients.
INPUT, RESULT, REFERENCE = "in", "out", "ref"
KINDS = (INPUT, RESULT, REFERENCE)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}\.(in|out|ref)")
_DOMAIN = re.compile(r"[0-9a-f]{32}")
# Linux >= 5.14: the pages of a private map mapped at once for reading, not one fault each (MAP_POPULATE would
# copy every page of a writable private map: 12 ms for 12.6 MB, against 1.5 ms). Older kernels: EINVAL, skipped.
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_TMP = ".tmp-"  # files being written: swept after TMP_MAX_AGE_S (their writer died)
_SPARE = ".spare-"  # pages kept for a process's next result or body (Spare): swept as temp files are
TMP_MAX_AGE_S = 120.0
DOMAIN_FILE = "domain"
LAUNCHER_FILE = "launcher.pid"  # `gradsvc up` claims the dir it made with its PID (gradsvc/runtime/launcher.py)

# What a result key holds when the result is in a file: 0xc1 is the one byte MessagePack never uses, so
# no MessagePack value (a GradientResult is a map: 0x80-0x8f, 0xde, 0xdf) starts with it.
MARKER = b"\xc1gradsvc-handoff:"


class HandoffError(ValueError):
    """A ref this process must not open: malformed, a hostile name, or another domain's."""


def _refuse_foreign(dir: Path) -> None:
    """An existing dir is taken only when it is the service's own (its domain file, which only a Handoff
    writes) or holds nothing the service did not make: the sweep deletes files by name and age, and must
    never meet an operator's `notes.in` or `run-2024.out`."""
    if (dir / DOMAIN_FILE).is_file():
        return
    with os.scandir(dir) as entries:
        # The domain file too: a racer making the dir's domain may have linked it since the look above
        # (Handoff._domain then checks what it holds).
        foreign = sorted(e.name for e in entries if not (e.name == LAUNCHER_FILE or e.name.startswith((_TMP, _SPARE))
                                                         or (e.name == DOMAIN_FILE and e.is_file())))
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise HandoffError(f"GRADSVC_HANDOFF_DIR={str(dir)!r} holds files gradsvc did not make ({shown}) and no "
                           f"{DOMAIN_FILE!r} file saying it is gradsvc's own; the service deletes the files it finds "
                           "there past their TTL, so it needs a directory of its own: point GRADSVC_HANDOFF_DIR at a "
                           "new or empty directory (created 0700), or move those files out")


def file_name(job_id: str, kind: str) -> str:
    name = f"{job_id}.{kind}"
    if kind not in KINDS or not _NAME.fullmatch(name):
        raise HandoffError(f"not a handoff name: {name!r}")
    return name


class Handoff:
    """One handoff dir. `put` writes a file (tmp + os.replace) and returns its ref; `get` reads one by ref
    (None when it is gone); `take` reads and deletes; `sweep` deletes files older than their kind's age.
    Its writer threads (stage) are its own, made here and ended by close()."""

    def __init__(self, dir: str | os.PathLike, min_bytes: int = 1 << 20) -> None:
        self.dir = Path(dir)
        self.min_bytes = min_bytes
        try:
            self.dir.mkdir(mode=0o700, parents=True)
        except FileExistsError:
            if not self.dir.is_dir():
                raise
            _refuse_foreign(self.dir)
        os.chmod(self.dir, 0o700)  # what mkdir's mode became under the umask, or an adopted empty dir's, exactly
        self.domain = self._domain()
        self._last_sweep = 0.0
        # Staged writes (stage) and the spares made after them: a few at once, each one syscall that releases
        # the GIL. Threads start with the first write.
        self.writers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="gradsvc-handoff")

    def close(self) -> None:
        """Ends the writer threads once the writes already started are done (the owner's exit)."""
        self.writers.shutdown(wait=True)

    def _domain(self) -> str:
        """This dir's id: read, or created once. Racers each write a temp file and link it to the final
        name; os.link fails for all but the first, who then read the winner's."""
        path = self.dir / DOMAIN_FILE
        for _ in range(2):
            try:
                found = path.read_text().strip()
            except FileNotFoundError:
                pass
            else:
                if not _DOMAIN.fullmatch(found):
                    raise HandoffError(f"{path} holds no handoff domain id ({found[:40]!r}); remove the file")
                return found
            tmp = self.dir / f"{_TMP}domain-{uuid.uuid4().hex}"
            self._write(tmp, uuid.uuid4().hex.encode())
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
            finally:
                tmp.unlink(missing_ok=True)
        return path.read_text().strip()

    # --- refs ---------------------------------------------------------------------------------------
    def ref(self, job_id: str, kind: str) -> str:
        return f"{self.domain}/{file_name(job_id, kind)}"

    def path(self, ref: str) -> Path:
        """The file a ref names in this dir; HandoffError unless it is this domain's and a valid name."""
        if not isinstance(ref, str) or ref.count("/") != 1:
            raise HandoffError(f"not a handoff ref: {str(ref)[:100]!r}")
        domain, name = ref.split("/")
        if domain != self.domain:
            raise HandoffError(f"handoff ref {ref[:100]!r} belongs to another domain (this dir's is {self.domain}): "
                               "it was written on another host or with another GRADSVC_HANDOFF_DIR")
        if not _NAME.fullmatch(name):
            raise HandoffError(f"not a handoff name: {name[:100]!r}")
        return self.dir / name

    def wanted(self, size: int) -> bool:
        return size >= self.min_bytes

    # --- files --------------------------------------------------------------------------------------
    @staticmethod
    def _write(path: Path, data, over: bool = False) -> None:
        """`data` as a new file at `path`; with `over`, written over the start of the existing file there
        (a Spare's), which is then cut to the data's size."""
        flags = os.O_WRONLY | os.O_NOFOLLOW | (0 if over else os.O_CREAT | os.O_EXCL)
        fd = os.open(path, flags, 0o600)
        try:
            view = memoryview(data).cast("B")
            size = len(view)
            while view:
                view = view[os.write(fd, view):]
            if over:
                os.ftruncate(fd, size)
        finally:
            os.close(fd)

    def _fill(self, dest: Path, data, spare: "Spare | None" = None, via: Path | None = None) -> None:
        """Writes `data` as the file `dest`, whole or not at all: into the pages of the `spare`'s file when it
        holds one, else into a new file (written at `via`, then renamed to `dest`, when given)."""
        kept = spare.take() if spare is not None else None
        if kept is not None:
            try:
                self._write(kept, data, over=True)
                os.replace(kept, dest)
                return
            except FileNotFoundError:  # the sweep took it (idle past TMP_MAX_AGE_S): a file of its own below
                pass
            except BaseException:
                kept.unlink(missing_ok=True)
                raise
        tmp = via or dest
        try:
            self._write(tmp, data)
            if via is not None:
                os.replace(via, dest)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def put(self, job_id: str, kind: str, data, spare: "Spare | None" = None) -> str:
        """Writes `data` as the file of (job_id, kind), whole or not at all; returns its ref. With a `spare`
        that holds a file, into that file's pages."""
        name = file_name(job_id, kind)
        self._fill(self.dir / name, data, spare, via=self.dir / f"{_TMP}{name}-{uuid.uuid4().hex[:8]}")
        return self.ref(job_id, kind)

    def stage(self, data, spare: "Spare | None" = None, refill: bool = True) -> "Staged":
        """Starts writing `data` (on a thread) as a temp file no job names yet: Staged.commit gives it a job's
        name, Staged.discard drops it. The API writes a large body so while it checks the request; with a
        `spare` that holds a file, into that file's pages, and once committed the spare is made again (unless
        not `refill`: the client releases its results, so its next request gives the spare this one's result
        file, Handoff.recycle)."""
        return Staged(self, data, spare, refill)

    def _open(self, ref: str) -> tuple[Path, int] | None:
        """(the path a ref names, the file open for reading), None when it is gone; symlinks are not followed.
        The fd holds a shared lock (flock) as long as it, or a map made of it, is open: recycle() leaves a
        file being read alone. A file recycled between the open and the lock no longer has its name: gone."""
        path = self.path(ref)
        fd = _opened(path)
        if fd is None:
            return None
        try:
            with contextlib.suppress(OSError):  # a filesystem without flock: recycle() cannot lock there either
                fcntl.flock(fd, fcntl.LOCK_SH)
            opened, named = os.fstat(fd), os.stat(path, follow_symlinks=False)
            if (opened.st_ino, opened.st_dev) == (named.st_ino, named.st_dev):
                return path, fd
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        return None

    def get(self, ref: str) -> bytes | None:
        opened = self._open(ref)
        if opened is None:
            return None
        with os.fdopen(opened[1], "rb") as f:
            return f.read()

    def take(self, ref: str) -> "bytes | mmap.mmap | None":
        """The file's bytes, and the file deleted (a job's body: read once). Mapped rather than read (the tmpfs's
        pages themselves, no copy; they go when the map does): a decoder reads it as it would bytes, and the
        tensors decoded from it are views of it. Mapped private and writable: a write into one of them makes
        a page of its own (copy on write) rather than a fault in a read-only map."""
        opened = self._open(ref)
        if opened is None:
            return None
        path, fd = opened
        try:
            data = _mapped(fd)
        finally:
            os.close(fd)
        path.unlink(missing_ok=True)
        return data

    def map(self, ref: str) -> "bytes | mmap.mmap | None":
        """The file's bytes mapped as take() maps them, the file kept (a result the API sends on: the file's
        own pages go to the socket, where a read copied 12.6 MB into fresh memory first); None when it is gone.
        A result's file is written in place only once recycled, renamed away under a lock the map's own
        lock holds off (recycle), so the map reads what was put."""
        opened = self._open(ref)
        if opened is None:
            return None
        try:
            return _mapped(opened[1])
        finally:
            os.close(opened[1])

    def delete(self, ref: str) -> None:
        self.path(ref).unlink(missing_ok=True)

    def recycle(self, ref: str, spare: "Spare") -> bool:
        """Deletes the file a ref names, its pages given to `spare` for this process's next write, unless
        someone reads it (the shared lock of _open: a map being sent): then it is only deleted, and that
        reader keeps its pages. Whether the spare took them."""
        path = self.path(ref)
        fd = _opened(path)
        if fd is None:
            return False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # someone reads it (BlockingIOError), or this filesystem has no flock
                path.unlink(missing_ok=True)
                return False
            return spare.keep(path)  # renamed under the lock: a reader waiting on it then finds the name gone
        finally:
            os.close(fd)

    def discard(self, job_id: str) -> None:
        """Deletes every file of a job or shard id (body, result, reference), whichever exist."""
        for kind in KINDS:
            (self.dir / file_name(job_id, kind)).unlink(missing_ok=True)

    def sweep(self, max_age_s: dict[str, float] | float) -> int:
        """Deletes the files older (by mtime) than their kind's age in `max_age_s` (or one age for all), and
        temp files and spares older than TMP_MAX_AGE_S; returns how many. The domain file stays."""
        ages = max_age_s if isinstance(max_age_s, dict) else dict.fromkeys(KINDS, max_age_s)
        now = time.time()
        removed = 0
        with os.scandir(self.dir) as entries:
            for entry in entries:
                name = entry.name
                if name.startswith((_TMP, _SPARE)):
                    age = TMP_MAX_AGE_S
                elif _NAME.fullmatch(name):
                    age = ages.get(name.rsplit(".", 1)[1])
                else:
                    continue  # the domain file, or something not ours
                if age is None:
                    continue
                try:
                    if entry.is_file(follow_symlinks=False) and now - entry.stat(follow_symlinks=False).st_mtime > age:
                        os.unlink(entry.path)
                        removed += 1
                except FileNotFoundError:
                    pass  # taken or deleted meanwhile
        self._last_sweep = time.monotonic()
        return removed

    def sweep_due(self, every_s: float = 60.0) -> bool:
        return time.monotonic() - self._last_sweep >= every_s

    # --- what result keys hold ----------------------------------------------------------------------
    @staticmethod
    def marker(ref: str) -> bytes:
        return MARKER + ref.encode()


class Spare:
    """One temp file of allocated tmpfs pages kept for the next file a process writes: a worker's next result
    (Handoff.put's `spare`), the API's next large body (Handoff.stage's). Each such file takes pages tmpfs
    has not handed out lately (a result is kept for GRADSVC_RESULT_TTL_S; a body's pages are the worker's
    until its job is done), and on a VM those come slowly: 12.6 MB took 9-13 ms written into new pages here,
    4-6 ms into pages allocated beforehand (posix_fallocate). The spare is made off the request's path, of
    the size just written: a worker's after its job, on its reaper thread (prepare); the API's once a staged
    body is committed, on the writers' thread. The next result or body of a training loop is the same size.
    A spare the sweep took (idle past TMP_MAX_AGE_S) or a full tmpfs only means the next write makes its
    own pages; drop() deletes it (the process's exit). One spare: of two writes at once, one makes its own.

    Allocating is not all: on a VM whose guest reports free memory to its host (free page reporting, this
    Firecracker VM's), a page free for more than a few seconds is handed back, and the first write to it
    waits on the host: 92.7 MB took 230-490 ms to write here, against 25-30 ms into pages freed just before
    (the kernel hands out those first). posix_fallocate takes pages without writing them, so a spare made
    from such pages is as slow to fill. Pages freed just before are quick only as long as the kernel does not
    merge them with free neighbours it handed back: the API's 12.7 MB body took 6-54 ms to write into the
    pages of a result deleted a moment before. What is always quick is pages that never left a file: the
    API's spare is the file of a result its client released with the request (Gradsvc-Release-Results,
    Handoff.recycle), the same 12.7 MB body then took 1.8-3.4 ms. The worker's spare is made as its job's
    body file goes (its pages)."""

    def __init__(self, handoff: Handoff) -> None:
        self.handoff = handoff
        self._path: Path | None = None
        self._lock = threading.Lock()
        self._dropped = False

    def prepare(self, size: int) -> None:
        """Allocates a file of `size` bytes to keep, unless one is kept already or the spare was dropped.
        OSError (a full tmpfs) is dropped: the spare is an optimisation."""
        with self._lock:
            if self._path is not None or self._dropped:
                return
        path = self.handoff.dir / f"{_SPARE}{uuid.uuid4().hex}"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
        except OSError as exc:
            path.unlink(missing_ok=True)
            log.debug("no spare file of %d bytes (%s)", size, exc)
            return
        with self._lock:
            if self._path is None and not self._dropped:
                self._path, path = path, None
        if path is not None:  # another prepare kept one meanwhile, or drop() came
            path.unlink(missing_ok=True)

    def take(self) -> Path | None:
        with self._lock:
            path, self._path = self._path, None
        return path

    def keep(self, path: Path) -> bool:
        """The file at `path` made the spare, in place of the one kept (deleted): a file already written, whose
        pages are the quick ones on a VM (above). False, the file deleted, once the spare is dropped or when
        the file is gone."""
        spare = self.handoff.dir / f"{_SPARE}{uuid.uuid4().hex}"
        with self._lock:
            if self._dropped:
                path.unlink(missing_ok=True)
                return False
            try:
                os.rename(path, spare)
                os.utime(spare)  # idle from now on, for the sweep (TMP_MAX_AGE_S), however old the result
            except FileNotFoundError:
                return False
            old, self._path = self._path, spare
        if old is not None:
            old.unlink(missing_ok=True)
        return True

    def drop(self) -> None:
        """Deletes the kept file, and any that a prepare still running makes (the process's exit)."""
        with self._lock:
            self._dropped = True
        path = self.take()
        if path is not None:
            path.unlink(missing_ok=True)


class Staged:
    """A file being written (Handoff.stage), not yet any job's. Whoever stages one commits or discards it;
    a temp file left behind (its process died) goes with the sweep after TMP_MAX_AGE_S."""

    def __init__(self, handoff: Handoff, data, spare: Spare | None = None, refill: bool = True) -> None:
        self.handoff, self.size = handoff, len(memoryview(data).cast("B"))
        self.spare = spare if refill else None  # the one made again once committed
        self.tmp = handoff.dir / f"{_TMP}staged-{uuid.uuid4().hex}"
        self.written = handoff.writers.submit(handoff._fill, self.tmp, data, spare)
        self.settled = False

    def commit(self, job_id: str, kind: str) -> str:
        """The file under (job_id, kind)'s name once written, and its ref; the write's OSError (a full tmpfs)
        if it failed, the file dropped. Once committed, the spare is made again (on a writer thread) for the
        next body."""
        name = file_name(job_id, kind)
        try:
            self.written.result()
            os.replace(self.tmp, self.handoff.dir / name)
        except BaseException:
            self.discard()
            raise
        self.settled = True
        if self.spare is not None:
            self.handoff.writers.submit(self.spare.prepare, self.size)
        return self.handoff.ref(job_id, kind)

    def discard(self) -> None:
        """Drops the file once its write is over, unless it was committed (then a no-op)."""
        if not self.settled:
            self.settled = True
            self.written.add_done_callback(lambda _: self.tmp.unlink(missing_ok=True))


def _opened(path: Path) -> int | None:
    """`path` open for reading, symlinks not followed; None when it is gone."""
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None


def _mapped(fd: int) -> "bytes | mmap.mmap":
    """An open file's bytes, mapped private and writable (a write into a tensor decoded from them is copy on
    write, not a fault in a read-only map) and populated at once for reading."""
    size = os.fstat(fd).st_size
    if not size:
        return b""
    data = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        data.madvise(_POPULATE_READ)
    except OSError:
        pass
    return data


def is_marker(raw) -> bool:
    return raw is not None and bytes(raw[:len(MARKER)]) == MARKER


def marker_ref(raw: bytes) -> str:
    return bytes(raw[len(MARKER):]).decode("ascii", errors="replace")


def load(raw: bytes | None, handoff: Handoff | None, mapped: bool = False) -> "bytes | mmap.mmap | None":
    """What a result (or reference) key's value stands for, whoever stored it: the value itself, or the
    file its marker names (None when the key or the file is gone: expired), read, or `mapped` (Handoff.map).
    A marker this process cannot open (handoff off here, another domain) raises HandoffError."""
    if raw is None or not is_marker(raw):
        return raw
    ref = marker_ref(raw)
    if handoff is None:
        raise HandoffError(f"a result was handed off outside Redis ({ref[:100]!r}) but this process has no "
                           "GRADSVC_HANDOFF_DIR")
    return handoff.map(ref) if mapped else handoff.get(ref)


def drop(raw: bytes | None, handoff: Handoff | None, spare: Spare | None = None) -> bool:
    """Deletes the file a result (or reference) key's value names, when it is a marker of `handoff`'s dir;
    whether it did. With a `spare`, its pages go to the spare unless someone reads it (Handoff.recycle); then
    whether the spare took them. A value stored in Redis, or a file of another host or domain (left to its
    own sweep), is not this process's to delete."""
    if handoff is None or raw is None or not is_marker(raw):
        return False
    try:
        ref = marker_ref(raw)
        if spare is not None:
            return handoff.recycle(ref, spare)
        handoff.delete(ref)
    except HandoffError:
        return False
    return True


def sweep_ages(result_ttl_s: float, failure_ttl_s: float, margin_s: float = 60.0) -> dict[str, float]:
    """How old each kind of file may grow: results and references as long as their key (plus a margin: the
    file is written just before the key), a body as long as a job that never ran is kept."""
    return {INPUT: float(failure_ttl_s), RESULT: result_ttl_s + margin_s, REFERENCE: result_ttl_s + margin_s}


def open_dir(dir: str, min_bytes: int) -> Handoff | None:
    """The process's handoff, or None when GRADSVC_HANDOFF_DIR is empty (off)."""
    return Handoff(dir, min_bytes) if dir else None


# The handoff reached through a Redis client, by code that RQ calls with only the client and a job (a shard's
# failure callback, gradsvc/broker/fanin.py): whoever owns both (the API's Queues, a worker's context) binds
# them once made. Not a process global: a client with none bound has no handoff.
_BOUND = "gradsvc_handoff"


def bind(connection, handoff: Handoff | None) -> None:
    """Makes `handoff` the one code reaching it through `connection` finds (bound)."""
    setattr(connection, _BOUND, handoff)


def bound(connection) -> Handoff | None:
    """The handoff bound to `connection`; None when there is none (the handoff off, or a client nobody bound)."""
    return getattr(connection, _BOUND, None)
