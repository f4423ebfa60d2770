"""Helpers every op shares: Triton launch settings (device facts, PDL) and in-kernel PDL waits."""
