"""Every Redis key and queue name gradsvc uses comes from here; none is built inline."""

from __future__ import annotations

import hashlib

QUEUE_DEVICES = ("auto", "cpu", "cuda")


def queue_name(prefix: str, device: str) -> str:
    """`auto` jobs go to the shared queue every worker drains; cpu/cuda jobs to their own."""
    return prefix if device == "auto" else f"{prefix}-{device}"


def domain_queue_name(prefix: str, device: str, domain: str) -> str:
    """A queue only the workers of one handoff domain drain (gradsvc/broker/handoff.py): jobs whose body or result
    is handed over as a file go there, so no worker that cannot open the file takes them."""
    return f"{queue_name(prefix, device)}@{domain}"


def in_domain(queue: str | None, domain: str) -> bool:
    """Whether a job that came through `queue` (its origin) came through one of `domain`'s queues."""
    return bool(queue) and queue.endswith(f"@{domain}")


def worker_queues(prefix: str, device: str, domain: str | None = None) -> list[str]:
    """A worker drains its own device's queue first, then the shared one; with a handoff domain, that
    domain's two queues before them."""
    plain = [queue_name(prefix, device), queue_name(prefix, "auto")]
    if not domain:
        return plain
    return [domain_queue_name(prefix, device, domain), domain_queue_name(prefix, "auto", domain), *plain]


def own_queue_name(prefix: str, worker_name: str) -> str:
    """The queue only one worker drains, first of its queues: jobs of a model it holds go there (affinity.route);
    the other workers' heartbeats move a job that waited there too long to the queue it would have gone to."""
    return f"{prefix}-own:{worker_name}"


def own_queue_worker(prefix: str, queue: str) -> str | None:
    """The worker whose own queue `queue` is, or None for any other queue."""
    head = f"{prefix}-own:"
    return queue[len(head):] if queue.startswith(head) else None


def holder_key(prefix: str, owner: str, model_key: str) -> str:
    """The worker that last kept the owner's model `model_key` (gradsvc/broker/affinity.py), with a TTL."""
    return f"{prefix}:holder:{owner}:{model_key}"


def affinity_waiting_key(prefix: str) -> str:
    """Jobs in a worker's own queue by the time they may wait there until (a sorted set of job ids); pinned
    jobs are not in it (they move only when their worker is gone)."""
    return f"{prefix}:affinity:waiting"


def affinity_pinned_key(prefix: str) -> str:
    """Pinned jobs in a worker's own queue (a set of job ids): moved only when that worker is gone."""
    return f"{prefix}:affinity:pinned"


def affinity_fallback_key(prefix: str) -> str:
    """Job id -> the queue a job in a worker's own queue moves to when it may not wait there any longer (a hash)."""
    return f"{prefix}:affinity:fallback"


def taken_key(prefix: str, worker_name: str) -> str:
    """The jobs a worker took from a queue beyond the one it runs, not started yet (a list of job ids,
    gradsvc/broker/takes.py): a job leaves it in the transaction that starts it."""
    return f"{prefix}:taken:{worker_name}"


def takers_key(prefix: str) -> str:
    """The workers that may hold taken jobs (a set of worker names): any worker's heartbeat puts a gone worker's
    taken jobs back at the front of their queues."""
    return f"{prefix}:takers"


def rq_queue_key(queue: str) -> str:
    """RQ's list of a queue's job ids."""
    from rq import Queue

    return Queue.redis_queue_namespace_prefix + queue


def rq_worker_key(worker_name: str) -> str:
    """RQ's hash of a live worker (its lease: GradientWorker renews its TTL every heartbeat)."""
    from rq.worker import Worker

    return Worker.redis_worker_namespace_prefix + worker_name


def rq_queue_workers_key(queue: str) -> str:
    """RQ's set of the workers that listen on a queue (rq.worker_registration); the API counts it."""
    from rq.worker_registration import WORKERS_BY_QUEUE_KEY

    return WORKERS_BY_QUEUE_KEY % queue


def result_key(prefix: str, job_id: str) -> str:
    return f"{prefix}:result:{job_id}"


def reference_key(prefix: str, job_id: str) -> str:
    """A shard's float64 reference gradients, kept for its reduce job's returned-gradient check."""
    return f"{prefix}:reference:{job_id}"


def owner_key(prefix: str, job_id: str) -> str:
    return f"{prefix}:owner:{job_id}"


def rate_key(prefix: str, key_id: str, window: int) -> str:
    return f"{prefix}:rate:{key_id}:{window}"


def rq_results_stream(job_id: str) -> str:
    """RQ's own results stream for a job (rq.results.Result.get_key); the API blocks on it."""
    from rq.results import Result

    return Result.get_key(job_id)


def cancel_key(prefix: str, job_id: str) -> str:
    """Set by POST /jobs/{id}/cancel for a running job; the job checks it between steps and stops."""
    return f"{prefix}:cancel:{job_id}"


def idempotency_key(prefix: str, owner: str, key: str) -> str:
    """Idempotency-Key -> job id, per owner: another API key's same header names another entry. The
    header is hashed, so what the client sends never becomes part of a Redis key."""
    return f"{prefix}:idem:{owner}:{hashlib.sha256(key.encode()).hexdigest()}"


def blob_key(prefix: str, owner: str, digest: str) -> str:
    """A piece of tensor bytes uploaded by PUT /tensors/{digest}, per owner: another key's same digest is
    another entry (a reference is usable only by the owner that sent the bytes)."""
    return f"{prefix}:blob:{owner}:{digest}"


def blob_index_key(prefix: str, owner: str) -> str:
    """The owner's pieces by last use (a sorted set): the byte budget evicts the least recently used."""
    return f"{prefix}:blobs:{owner}"


def blob_sizes_key(prefix: str, owner: str) -> str:
    """The owner's pieces' sizes (a hash), for the byte budget."""
    return f"{prefix}:blob-sizes:{owner}"


# The owner of requests sent without API keys (GRADSVC_API_KEYS empty): every caller is one owner.
ANONYMOUS_OWNER = "anonymous"


def graph_key(prefix: str, owner: str, digest: str) -> str:
    """A validated graph's canonical MessagePack, kept under its content hash (`model.graph_ref`) for the
    owner (API key digest) that sent it: another owner's same ref names another entry, so it reads as unknown."""
    return f"{prefix}:graph:{owner}:{digest}"


def owner_jobs_key(prefix: str, owner: str) -> str:
    """A sorted set of the owner's recent job ids, scored by submission time (service/recent.py keeps it
    bounded); the job pages list it."""
    return f"{prefix}:jobs:{owner}"


def page_login_key(prefix: str, token: str) -> str:
    """A browser's login to the pages (service/page_login.py) -> its owner. The cookie's token is hashed, so what the
    browser holds never becomes part of a Redis key."""
    return f"{prefix}:session:{hashlib.sha256(token.encode()).hexdigest()}"


def epoch_key(prefix: str) -> str:
    """The current data epoch: "<8 hex> <unix time it began> <run_id of the Redis it began on>", created
    when missing. Redis restarted empty has none, so the next reader starts a new epoch: job ids carry the
    epoch they were issued in (their last 8 hex digits), which tells a job Redis lost from one that never
    existed (service/epochs.py: also when another Redis process may have lost the last writes)."""
    return f"{prefix}:epoch"


def replication_mark_key(prefix: str) -> str:
    """A counter the API increments right before a WAIT (with Sentinel): the WAIT then covers every write
    Redis ran before it, whichever connection sent them."""
    return f"{prefix}:replicated"


def past_epochs_key(prefix: str) -> str:
    """The epochs before the current one that an API process remembered when it started a new one."""
    return f"{prefix}:epochs"


def runs_key(prefix: str, owner: str) -> str:
    """The owner's runs by name (a sorted set scored by the time of each run's last step)."""
    return f"{prefix}:runs:{owner}"


def run_base(prefix: str, owner: str) -> str:
    """What every key of one of the owner's runs starts with; run_key appends the name's digest and the part.
    gradsvc/broker/runs.py's record script builds the same keys from this base (Redis's sha1hex of the name),
    to drop the runs an owner's bound evicts within the same script; a test pins the two to agree."""
    return f"{prefix}:run:{owner}:"


def run_key(prefix: str, owner: str, name: str, part: str) -> str:
    """A run's `steps` (a sorted set of encoded steps scored by step number) or `weights` (the previous step's
    weights, for the update ratio). The name is hashed: what the client sends never becomes part of a key."""
    return f"{run_base(prefix, owner)}{hashlib.sha1(name.encode()).hexdigest()}:{part}"


def run_weights_sizes_key(prefix: str, owner: str) -> str:
    """The bytes of each of the owner's runs' kept weights (a hash by run name): what the owner's byte budget
    (GRADSVC_TENSOR_BUDGET_BYTES) counts of its runs, beside its tensor pieces."""
    return f"{prefix}:run-weights:{owner}"


def run_exports_key(prefix: str) -> str:
    """Every owner's runs ("<owner> <name>") by the time of their last step: the API's /metrics exports the
    most recent of them."""
    return f"{prefix}:run-exports"


def run_job_key(prefix: str, job_id: str) -> str:
    """The run and step a finished job was recorded as (a hash): written once, so a job recorded already (a
    retried transaction) records nothing again; the job page links to its run from it."""
    return f"{prefix}:run-job:{job_id}"


def write_probe_key(prefix: str) -> str:
    """What /readyz and a starting worker write (a byte, for seconds) to learn whether Redis takes writes: at
    maxmemory, read-only after a failover or failing its snapshots it answers reads and refuses writes."""
    return f"{prefix}:write-probe"


def login_failures_key(prefix: str, client: str, window: int) -> str:
    """Failed /ui/login attempts from one client address in one minute (service/page_login.py throttles them)."""
    return f"{prefix}:login-failures:{client}:{window}"


def worker_devices_key(prefix: str) -> str:
    """A hash: each live worker's key (RQ's `rq:worker:<name>`) -> its device as JSON (kind, name, total_bytes),
    written at its start and every heartbeat and deleted at its stop (gradsvc/broker/devices.py); the API reads
    the devices' memory from it for the limits of the workers a job may go to."""
    return f"{prefix}:worker-devices"


# --- Training sessions (gradsvc/broker/session_records.py) ------------------------------------------------

def training_session_key(prefix: str, session_id: str) -> str:
    """A training session's record (a hash: owner, holder, step, ...), expiring GRADSVC_SESSION_IDLE_TTL_S after
    its last use. ("session" alone names the pages' login cookie: page_login_key.)"""
    return f"{prefix}:tsession:{session_id}"


def training_session_state_key(prefix: str, session_id: str) -> str:
    """The session's last checkpoint: its state as one safetensors file."""
    return f"{prefix}:tsession:{session_id}:state"


def training_session_answer_key(prefix: str, session_id: str, name: str) -> str:
    """The answer of one of a session's jobs (`name`: session_records.job_answer_name), read once by the API."""
    digest = hashlib.sha256(name.encode()).hexdigest()[:32]
    return f"{prefix}:tsession:{session_id}:answer:{digest}"


def training_session_answers_key(prefix: str, session_id: str) -> str:
    """The answers of the steps a session applied under the idempotency keys it remembers: a hash, the key's
    digest (answer_field) -> the answer, written with the record by the holder's commit and living as long."""
    return f"{prefix}:tsession:{session_id}:answers"


def answer_field(idempotency_key: str) -> str:
    return hashlib.sha256(idempotency_key.encode()).hexdigest()[:32]


def training_sessions_key(prefix: str, owner: str) -> str:
    """One owner's sessions: a hash, session id -> the bytes its state holds (written with its record; ids whose
    record expired are dropped when counted). POST /sessions counts and sums it atomically (session_records.py)."""
    return f"{prefix}:tsessions-bytes:{owner}"


def training_session_created_key(prefix: str, owner: str, idempotency_key: str) -> str:
    """The session a POST /sessions under this Idempotency-Key created (its retry answers it again)."""
    return f"{prefix}:tsession-created:{owner}:{hashlib.sha256(idempotency_key.encode()).hexdigest()}"


def training_session_report_key(prefix: str, session_id: str, call: str, rank: int) -> str:
    """A session over several workers: what member `rank` holds at the start of call `call` (its formation and
    step), read by every member to agree whether their process group and replicas go on (workers/session_group.py)."""
    return f"{prefix}:tsession:{session_id}:report:{call}:{rank}"


def training_session_rendezvous_key(prefix: str, session_id: str, formation: str) -> str:
    """The address of the store rank 0 serves for the rendezvous of one formation of a session's members."""
    return f"{prefix}:tsession:{session_id}:rendezvous:{formation}"
