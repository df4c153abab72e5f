"""Network emulation for experiments and tests: a TCP proxy with delay, jitter, bandwidth and faults."""
