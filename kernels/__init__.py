"""Every op twice: a plain-torch reference (CPU, the oracle) and a fast CUDA path.

One package per op (`gdn/`, `kda/`, `conv/`, `attention/`, `mla/`, `moe/`, `norm/`, `router/`,
`fp8/`, `linear/`, `window/`): its `__init__` holds the public op, which dispatches on the device
of its inputs (`dispatch.use_fast_path`), beside its torch reference; `cuda.py` holds the CUDA
launchers and `triton.py` the Triton kernels, both imported lazily so that CPU paths import
cleanly. Importing this package changes nothing in the process: FLA's switch is set by
`delta_rule.fla.configure_fla`, called by the engine at start-up and before FLA is imported.
"""
