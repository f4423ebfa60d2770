"""Logits to tokens: `Sampler` (`sampler.py`) over the batch ops it shares with its CUDA-graph
replay (`ops.py`, `sampler_graphs.py`), penalties (`penalties.py`) and grammar masks for
structured outputs (`structured.py`).
"""
