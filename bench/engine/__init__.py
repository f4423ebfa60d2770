"""Offline-engine benchmarks and profiles: decode, prefill, host time, sampling, speculation, caching."""
