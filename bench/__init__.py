"""Benchmarks: the harness behind `specedge bench` and the scripts behind BENCHMARKS.md."""
