"""What the tests and the benches share (bench/ imports it; nothing here is a test): stack.py (a real
stack as subprocesses, and `gradsvc up`), models.py (the model zoo), nets.py (layer-spec nets, wire
tensors), layer_samples.py (every layer type at each argument value), prometheus.py (a real Prometheus
scraping a stack)."""
