"""Engine arguments (the CLI's flags mirror these, kebab-case)."""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from deltaserve.engine.cache.cache_policy import POLICIES

if TYPE_CHECKING:
    from deltaserve.engine.spec_decode.config import SpecConfig
    from deltaserve.models.parallel import TensorParallel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's spellings
# the fields set to whole numbers (None where the field allows it), and those set to real numbers
INT_FIELDS = (
    "max_running_requests",
    "max_waiting_requests",
    "max_model_len",
    "max_num_batched_tokens",
    "chunked_prefill_size",
    "max_prefill_delay_steps",
    "page_size",
    "seed",
    "num_kv_pages",
    "num_snapshot_slots",
    "cuda_graph_max_bs",
    "piecewise_cuda_graph_max_tokens",
    "stream_interval",
    "tensor_parallel_size",
    "nnodes",
    "node_rank",
    "master_port",
    "data_parallel_size",
    "data_parallel_rank",
)
FLOAT_FIELDS = ("prefix_cache_alpha", "mem_fraction_static", "pool_memory_gb", "distributed_timeout_s")
# the switches (None where the field allows it: its default, resolved by device)
BOOL_FIELDS = (
    "skip_tokenizer_init",
    "adaptive_prefill_delay",
    "hold_prefill_tails",
    "language_model_only",
    "disable_cuda_graph",
    "enable_overlap_schedule",
    "warmup",
    "enable_expert_parallel",
)
AUTO_MAX_MODEL_LEN = -1  # vLLM's: the longest context the pools hold, up to the model's positions
_OPTIONAL = {
    "max_running_requests",
    "max_model_len",
    "max_num_batched_tokens",
    "chunked_prefill_size",
    "num_kv_pages",
    "num_snapshot_slots",
    "master_port",
    "pool_memory_gb",
    "adaptive_prefill_delay",
    "enable_overlap_schedule",
    "warmup",
}


class SettingError(ValueError):
    """A setting's value refused; `setting` names the field, so that a caller who spelled it
    otherwise (LLM's vLLM names) can name it as given."""

    def __init__(self, setting: str, problem: str) -> None:
        super().__init__(f"{setting} {problem}")
        self.setting = setting
        self.problem = problem

    def __reduce__(self) -> tuple[type[SettingError], tuple[str, str]]:
        return type(self), (self.setting, self.problem)


@dataclass
class EngineConfig:
    model: str
    served_model_name: str | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False  # vLLM's: no tokenizer loaded, token-id prompts and outputs only
    dtype: str | None = None  # None: bfloat16 on CUDA, float32 on CPU
    device: str | None = None  # None: cuda when available
    max_running_requests: int | None = None  # None: 256 on CUDA, 64 on CPU (clamped to what memory holds)
    max_waiting_requests: int = 1024
    # "fcfs": requests are admitted in arrival order and memory pressure preempts the newest;
    # "priority": by their `priority` (lower first, then arrival) and it preempts the lowest (vLLM's)
    scheduling_policy: str = "fcfs"
    # None: the model's positions; -1 (vLLM's auto): those, lowered to what the pools hold for one request
    max_model_len: int | None = None
    # a step's token budget (decode rows count too) and the largest prefill chunk of one request;
    # None: 8192 on CUDA, 512 on CPU, and the chunk as large as the budget
    max_num_batched_tokens: int | None = None
    chunked_prefill_size: int | None = None
    # new prompts arriving beside decode-only steps wait up to this many steps to be prefilled
    # together (a prefill step runs eagerly, a decode step by CUDA graph); 0: never wait
    max_prefill_delay_steps: int = 0
    # ... and with this, wait while one more step's wait costs less than it saves, as measured
    # (engine/step/step_costs.py); the steps' cap is then max_prefill_delay_steps or 16.
    # None: on CUDA, where decode steps replay graphs and prefill steps launch eagerly
    adaptive_prefill_delay: bool | None = None
    # with the adaptive delay, running prompts' remaining chunks (the short tail the prefix cache
    # leaves after a prompt's last full page) wait with the arrivals too, under the same rule
    hold_prefill_tails: bool = False
    page_size: int = 16
    cache_type: str = "radix"  # "naive": no reuse across requests
    prefix_cache_policy: str = "marconi"  # snapshot admission / eviction: see cache/cache_policy.py
    prefix_cache_alpha: float = 1.0  # marconi's weight of FLOPs saved per byte against recency
    state_dtype: str = "float32"
    seed: int = 0
    load_format: str = "auto"
    # "fp8": quantize an unquantized checkpoint to block FP8 at load (models/checkpoints/quantization.py);
    # block-FP8 checkpoints are recognised from their config either way
    quantization: str | None = None
    # values set on the checkpoint's config before the model is built (vLLM's --hf-overrides), e.g.
    # {"text_config": {"rope_parameters": {... "rope_type": "yarn" ...}}} for contexts past the native length
    hf_overrides: dict[str, Any] | None = None
    # a vision-language checkpoint served as text alone: its vision tower is not loaded
    language_model_only: bool = False
    mem_fraction_static: float = 0.85
    # KV and state pools' memory (on CUDA instead of mem_fraction_static); None: CPU a quarter of what is free
    pool_memory_gb: float | None = None
    num_kv_pages: int | None = None  # overrides the memory-based sizing
    num_snapshot_slots: int | None = None  # radix: default two per running request
    disable_cuda_graph: bool = False
    # launch step N+1 before reading step N's tokens back (engine/step/overlap.py);
    # None: on for CUDA devices (where the GPU runs asynchronously), off on CPU
    enable_overlap_schedule: bool | None = None
    cuda_graph_max_bs: int = 256
    # mixed steps of up to this many tokens replay CUDA graphs of the forward's pieces between
    # the attention and linear-attention ops (engine/runner/piecewise_graphs.py); 0: eagerly
    piecewise_cuda_graph_max_tokens: int = 0
    # streamed ("delta") requests get an output once this many new tokens are in, besides their
    # first token and their end (vLLM's and SGLang's stream interval): fewer, larger chunks
    stream_interval: int = 1
    # {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": m, ...}: see
    # engine/spec_decode/config.py
    speculative_config: dict[str, Any] | None = None
    # run a few prompts at start-up so that kernels compile before the first request;
    # None: on CUDA (where compiling and autotuning take seconds), off on CPU
    warmup: bool | None = None
    # tensor parallelism (engine/parallel/): one process per rank; rank 0 schedules and samples.
    # Ranks are spread evenly over `nnodes` machines, which meet at master_addr:master_port
    # (torch.distributed's TCP rendezvous); None: a free port on this machine (one node only)
    tensor_parallel_size: int = 1
    # MoE experts placed whole, num_experts / tensor_parallel_size per rank, instead of each rank
    # holding every expert's slice (EP size = TP size, as vLLM's); no effect at one rank
    enable_expert_parallel: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    distributed_timeout_s: float = 300.0  # how long the ranks wait for each other to join
    # data parallelism (server/launch.py starts the replicas): this engine is replica `data_parallel_rank` of
    # `data_parallel_size`, each on its own GPUs (tensor_parallel_size of them), fed its own requests
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # a process group the caller already runs, one engine per rank fed the same requests (the
    # ranks stay in step without the engine's own step sync); never pickled
    tensor_parallel: TensorParallel | None = field(default=None, repr=False, compare=False)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._check_numbers()
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.enable_overlap_schedule is None:
            self.enable_overlap_schedule = torch.device(self.device).type == "cuda"
        if self.dtype is None or self.dtype == "auto":
            self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.state_dtype not in DTYPES:
            raise ValueError(f"state_dtype must be one of {sorted(DTYPES)}, got {self.state_dtype!r}")
        if self.load_format == "safetensors":  # vLLM's name for what auto loads
            self.load_format = "auto"
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(
                f"load_format must be 'auto', 'safetensors' or 'dummy', got {self.load_format!r}"
            )
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be 'fp8' or None, got {self.quantization!r}")
        if self.cache_type not in ("naive", "radix"):
            raise ValueError(f"cache_type must be 'radix' or 'naive', got {self.cache_type!r}")
        if self.prefix_cache_policy not in POLICIES:
            raise ValueError(
                f"prefix_cache_policy must be one of {', '.join(POLICIES)}, got {self.prefix_cache_policy!r}"
            )
        if self.prefix_cache_alpha < 0:
            raise ValueError("prefix_cache_alpha must be non-negative")
        on_cuda = torch.device(self.device).type == "cuda"
        if self.warmup is None:
            self.warmup = on_cuda
        if self.adaptive_prefill_delay is None:
            self.adaptive_prefill_delay = on_cuda
        if self.hold_prefill_tails and not self.adaptive_prefill_delay:
            # the tails wait under the adaptive delay's rule: without it the flag would do nothing
            raise ValueError(
                "hold_prefill_tails (--hold-prefill-tails) holds tails under the adaptive prefill delay, "
                "which is off here: give --adaptive-prefill-delay too (LLM: adaptive_prefill_delay=True; "
                "it is on by default only on CUDA)"
            )
        if self.max_running_requests is None:
            self.max_running_requests = 256 if on_cuda else 64
        if self.max_running_requests < 1:
            raise SettingError("max_running_requests", f"must be at least 1, got {self.max_running_requests}")
        # the CLI's own bounds, for the LLM's arguments too
        if self.max_model_len not in (None, AUTO_MAX_MODEL_LEN) and self.max_model_len < 2:
            raise ValueError(
                f"max_model_len must be at least 2 (a one-token prompt and its first token), or -1 for "
                f"the longest the pools hold, got {self.max_model_len}"
            )
        if not 0 < self.mem_fraction_static <= 1:
            raise SettingError(
                "mem_fraction_static", f"must be a fraction in (0, 1], got {self.mem_fraction_static}"
            )
        if self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be at least 0, got {self.max_waiting_requests}")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be at least 1, got {self.cuda_graph_max_bs}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(8192 if on_cuda else 512, self.chunked_prefill_size or 0)
        if self.chunked_prefill_size is None:
            self.chunked_prefill_size = self.max_num_batched_tokens
        if self.chunked_prefill_size < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("chunked_prefill_size and max_num_batched_tokens must be at least 1")
        # a chunk is never more than its step holds; a larger one rounded a small budget's chunks
        # down to nothing, and the waiting queue stalled
        self.chunked_prefill_size = min(self.chunked_prefill_size, self.max_num_batched_tokens)
        if self.max_prefill_delay_steps < 0:
            raise ValueError("max_prefill_delay_steps must be at least 0")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )
        if self.stream_interval < 1:
            raise ValueError("stream_interval must be at least 1")
        if self.pool_memory_gb is not None and self.pool_memory_gb <= 0:
            raise SettingError("pool_memory_gb", f"must be positive, got {self.pool_memory_gb}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise SettingError("page_size", f"must be a power of two, got {self.page_size}")
        _ = self.spec  # validates speculative_config
        self._check_parallel()
        from deltaserve.engine.requests.sampling_params import grammar_timeout_s
        from deltaserve.kernels.common.fast_launch import fast_launch_mode
        from deltaserve.kernels.common.launch import pdl_mode
        from deltaserve.kernels.delta_rule.fla import fla_direct
        from deltaserve.kernels.dispatch import reference_kernels_mode
        from deltaserve.kernels.fp8.cuda import fp8_decode_mode
        from deltaserve.kernels.linear import gemv_mode
        from deltaserve.kernels.mla import mla_prefill_mode
        from deltaserve.kernels.moe.cuda import moe_gemm_mode

        gemv_mode()  # DELTASERVE_GEMV: a typo fails at start-up, not as a silent default
        pdl_mode()  # DELTASERVE_PDL, likewise
        mla_prefill_mode()  # DELTASERVE_MLA_PREFILL
        moe_gemm_mode()  # DELTASERVE_MOE_GEMM
        fast_launch_mode()  # DELTASERVE_FAST_LAUNCH (Triton itself is imported where kernels run)
        fp8_decode_mode()  # DELTASERVE_FP8_DECODE: otherwise first read by an FP8 forward, mid-serving
        fla_direct()  # DELTASERVE_FLA_DIRECT
        reference_kernels_mode()  # DELTASERVE_REFERENCE_KERNELS
        grammar_timeout_s()  # DELTASERVE_GRAMMAR_TIMEOUT

    def _check_numbers(self) -> None:
        """Integer fields hold ints (numpy's become Python's), real ones finite numbers and
        switches bools: a string, a fraction or a bool is a ValueError naming the field, not a
        comparison's TypeError later, a length of 2.5 or a switch set by "False" accepted."""
        for name in INT_FIELDS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            try:
                if isinstance(value, bool):  # True is 1 to Python, never a length or a count here
                    raise TypeError
                setattr(self, name, operator.index(value))
            except TypeError:
                raise SettingError(name, f"must be an integer, got {value!r}") from None
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise SettingError(name, f"must be a number, got {value!r}")
            setattr(self, name, float(value))
        for name in BOOL_FIELDS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            # a string such as "False" is truthy: taken, it would turn the switch on
            if not isinstance(value, (bool, np.bool_)):
                raise SettingError(name, f"must be True or False, got {value!r}")
            setattr(self, name, bool(value))

    def _check_parallel(self) -> None:
        tp, nnodes = self.tensor_parallel_size, self.nnodes
        if tp < 1 or nnodes < 1:
            raise ValueError("tensor_parallel_size and nnodes must be at least 1")
        if tp % nnodes:
            raise ValueError(f"tensor_parallel_size {tp} does not spread evenly over {nnodes} nodes")
        if not 0 <= self.node_rank < nnodes:
            raise ValueError(f"node_rank must be in [0, {nnodes}), got {self.node_rank}")
        if nnodes > 1 and self.master_port is None:
            raise ValueError("more than one node needs master_port (and master_addr: node 0's address)")
        if self.distributed_timeout_s <= 0:
            raise ValueError("distributed_timeout_s must be positive")
        if self.data_parallel_size < 1 or not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank must be in [0, data_parallel_size), got {self.data_parallel_rank} "
                f"of {self.data_parallel_size}"
            )
        if self.data_parallel_size > 1 and nnodes > 1:
            raise ValueError("data parallelism over more than one node is not implemented")

    def data_parallel_replica(self, rank: int) -> EngineConfig:
        """The config of replica `rank`: on CUDA the GPUs after those of the replicas before it
        (`tensor_parallel_size` each, from the device given), its own rendezvous port."""
        device = torch.device(self.device or "cpu")
        if device.type == "cuda":
            device = torch.device("cuda", (device.index or 0) + rank * self.tensor_parallel_size)
        port = None if self.master_port is None else self.master_port + rank
        return replace(self, device=str(device), master_port=port, data_parallel_rank=rank)

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def node_ranks(self) -> range:
        """The tensor-parallel ranks that run on this node."""
        per = self.ranks_per_node
        return range(self.node_rank * per, (self.node_rank + 1) * per)

    @property
    def torch_dtype(self) -> torch.dtype:
        assert self.dtype is not None
        return DTYPES[self.dtype]

    @property
    def torch_state_dtype(self) -> torch.dtype:
        return DTYPES[self.state_dtype]

    @property
    def spec(self) -> SpecConfig | None:
        from deltaserve.engine.spec_decode.config import SpecConfig

        if self.speculative_config is None:
            return None
        return SpecConfig.from_dict(self.speculative_config)

    @property
    def spec_window_rows(self) -> int:
        """Requests verified per step: each holds k + 1 states per linear layer in the window."""
        spec = self.spec
        if spec is None:
            return 0
        return min(spec.max_batch or 32, self.num_running)

    @property
    def num_running(self) -> int:
        """max_running_requests, resolved (it is None only before __post_init__)."""
        assert self.max_running_requests is not None
        return self.max_running_requests

    @property
    def chunk_size(self) -> int:
        assert self.chunked_prefill_size is not None
        return self.chunked_prefill_size

    @property
    def step_tokens(self) -> int:
        assert self.max_num_batched_tokens is not None
        return self.max_num_batched_tokens

    @property
    def chunk_align(self) -> int:
        """Non-final prefill chunks are multiples of this (prefix-cache snapshots sit there)."""
        return min(64, self.chunk_size)
