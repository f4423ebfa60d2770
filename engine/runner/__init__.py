"""Running the model: one step's batch as device tensors (`forward_batch.py`, `h2d.py`), the
two backends a forward's layers call (`attention_backend.py`, `linear_backend.py`: they implement
the Protocols of `models/forward.py`), `ModelRunner` (`model_runner.py`, which hands the model
the backends side by side) and decode by CUDA-graph replay (`cuda_graphs.py`).
"""
