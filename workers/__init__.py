"""The queue side: the RQ job functions (jobs.py, shards.py), the worker process (worker.py, main.py), its
watchdog and its Prometheus metrics. The engine they run is gradsvc.engine, shared with the API."""
