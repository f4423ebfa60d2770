"""Benchmarks of the HTTP side: load on a server, its step logs, the host cost of streaming outputs."""
