"""Microbenchmarks of single kernels and matmuls on one GPU."""
