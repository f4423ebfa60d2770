"""Running the model: one step's batch as device tensors (`forward_batch.py`, `h2d.py`), the
two backends a forward's layers call (`attention_backend.py`, `linear_backend.py`, side by side
in `forward_context.py`), `ModelRunner` (`model_runner.py`) and decode by CUDA-graph replay
(`cuda_graphs.py`).
"""
