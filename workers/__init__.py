"""The queue side: the RQ job function, the worker process, the serializer, the worker's metrics."""
