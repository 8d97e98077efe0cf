"""Benchmark harness: candidate vs baseline, interleaved in one run."""
