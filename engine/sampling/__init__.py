"""Logits to tokens: `Sampler` (`sampler.py`), the same ops by CUDA-graph replay
(`sampler_graphs.py`), penalties (`penalties.py`) and grammar masks for structured outputs
(`structured.py`).
"""
