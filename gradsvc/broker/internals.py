"""The RQ and redis-py internals gradsvc relies on: what, where, why, and the versions checked (RQ 3.0.0,
redis-py 8.1.0). tests/gradsvc/broker/test_internals.py pins each entry: it fails when one of them is gone or
its parameters change, and when the worker overrides a SimpleWorker method this table does not list. An
upgrade of either library starts there.

RQ's SimpleWorker, overridden by workers/worker.py's GradientWorker (rq's own SimpleWorker overrides two
methods; each further one is listed with its reason):

    __init__                  the process's WorkerContext, the leases (workers/leasing.py), the watchdog
    get_heartbeat_ttl         a job is leased for 3 heartbeats, not job_timeout + 60 s
    heartbeat, set_state      the worker key is kept by the heartbeat thread, not the main loop
    prepare_execution         the start-of-job MULTI/EXEC is built, not executed (sent by the next method)
    prepare_job_execution     ...and sent without waiting for its reply (workers/transaction.py)
    handle_execution_ended    the start transaction's reply is read before the end is recorded
    handle_job_failure        the same, on failure; a job reaped meanwhile is left failed (Leases.reaped)
    handle_job_success        the result is written in RQ's success transaction (GradientJob._handle_success)
    execute_job               the context handed to the job (workers/jobs.py), the Running record around it
    bootstrap, teardown       the heartbeat thread (workers/leasing.py) starts and stops with the worker
    unsubscribe               the wait for RQ's pubsub thread is bounded (redis-py's stop() waits unbounded)
    check_for_suspension      checked once a second at most, not before every job
    run_maintenance_tasks     expired leases are reaped by the heartbeat thread instead
    dequeue_job_and_maintain_ttl
                              Redis refusing writes (OOM, READONLY, a failover's UNBLOCKED) is waited out
                              as RQ waits out a lost connection, not the end of the worker

Private or undocumented names used:

    rq.job.Job._handle_success      GradientJob writes the result in the same transaction (gradsvc/broker/job.py)
    rq.job.Job._data                GradientJob stores the body uncompressed (to_dict)
    rq.job.Job._status              the worker sets the finished status its transaction wrote
    rq.worker.SimpleWorker._state   set_state keeps RQ's own field in step; the success transaction sets it to
                                    idle once its write is done (a SIGTERM meanwhile finds the worker busy)
    rq.worker.SimpleWorker.pubsub, pubsub_thread, redis.client.PubSubWorkerThread.stop(timeout)
                                    the worker's command channel, stopped with a bounded wait (unsubscribe)
    rq.worker_registration.WORKERS_BY_QUEUE_KEY, rq.results.Result.get_key
                                    key names the API reads (gradsvc/broker/keys.py)
    RQ's storage layout: a queue's list (Queue.redis_queue_namespace_prefix + name), a job hash's `origin`
    field, the set of queues (Queue.redis_queues_keys), a worker's key (Worker.redis_worker_namespace_prefix)
                                    affinity's scripts move a queued job between queues and ask whether a worker
                                    lives (gradsvc/broker/affinity.py)
    redis.client.Pipeline.command_stack, redis.client.EMPTY_RESPONSE
                                    a pipeline's queued commands, sent as one packed write (service/enqueue.py,
                                    workers/transaction.py, workers/worker.py)
    redis.connection.Connection.send_packed_command, pack_commands; the asyncio Connection's _writer and
    send_packed_command             one write per round trip on the request path (gradsvc/broker/connection.py)
"""

from __future__ import annotations

# (dotted name, the parameter names it is called or overridden with); None: an attribute, not a callable.
RELIED_ON: tuple[tuple[str, tuple[str, ...] | None], ...] = (
    ("rq.worker.SimpleWorker.__init__", ("self", "queues", "name", "default_result_ttl", "connection",
                                         "exception_handlers", "maintenance_interval", "default_worker_ttl",
                                         "worker_ttl", "job_class", "queue_class", "log_job_description",
                                         "job_monitoring_interval", "disable_default_exception_handler",
                                         "prepare_for_work", "serializer", "work_horse_killed_handler")),
    ("rq.worker.SimpleWorker.get_heartbeat_ttl", ("self", "job", "working_time")),
    ("rq.worker.SimpleWorker.heartbeat", ("self", "timeout", "pipeline")),
    ("rq.worker.SimpleWorker.set_state", ("self", "state", "pipeline")),
    ("rq.worker.SimpleWorker.prepare_execution", ("self", "job")),
    ("rq.worker.SimpleWorker.prepare_job_execution", ("self", "job", "remove_from_intermediate_queue")),
    ("rq.worker.SimpleWorker.handle_execution_ended", ("self", "job", "queue", "heartbeat_ttl")),
    ("rq.worker.SimpleWorker.handle_job_failure", ("self", "job", "queue", "started_job_registry", "exc_string",
                                                   "execution")),
    ("rq.worker.SimpleWorker.handle_job_success", ("self", "job", "queue", "started_job_registry", "execution")),
    ("rq.worker.SimpleWorker.execute_job", ("self", "job", "queue")),
    ("rq.worker.SimpleWorker.bootstrap", ("self", "logging_level", "date_format", "log_format")),
    ("rq.worker.SimpleWorker.teardown", ("self",)),
    ("rq.worker.SimpleWorker.unsubscribe", ("self",)),
    ("redis.client.PubSubWorkerThread.stop", ("self", "timeout")),
    ("rq.worker.SimpleWorker.check_for_suspension", ("self", "burst")),
    ("rq.worker.SimpleWorker.run_maintenance_tasks", ("self",)),
    ("rq.worker.SimpleWorker.dequeue_job_and_maintain_ttl", ("self", "timeout", "max_idle_time")),
    ("rq.job.Job._handle_success", ("self", "result_ttl", "pipeline", "worker_name", "execution_id",
                                    "execution_started_at", "execution_ended_at")),
    ("rq.job.Job.restore", ("self", "raw_data")),
    ("rq.job.Job.to_dict", ("self", "include_meta", "include_result")),
    ("rq.worker_registration.WORKERS_BY_QUEUE_KEY", None),
    ("rq.results.Result.get_key", ("cls", "job_id")),
    ("redis.client.EMPTY_RESPONSE", None),
    ("redis.connection.Connection.send_packed_command", ("self", "command", "check_health")),
    ("redis.connection.Connection.pack_commands", ("self", "commands")),
    ("redis.asyncio.connection.Connection.send_packed_command", ("self", "command", "check_health")),
)

# Instance attributes (set in __init__, so not on the class): (class, attribute).
INSTANCE_FIELDS: tuple[tuple[str, str], ...] = (
    ("rq.job.Job", "_data"),
    ("rq.job.Job", "_status"),
    ("rq.worker.SimpleWorker", "_state"),
    ("rq.worker.SimpleWorker", "pubsub"),
    ("rq.worker.SimpleWorker", "pubsub_thread"),
    ("redis.client.Pipeline", "command_stack"),
    ("redis.asyncio.connection.Connection", "_writer"),
)
