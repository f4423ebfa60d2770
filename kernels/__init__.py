"""Every op twice: a plain-torch reference (CPU, the oracle) and a fast CUDA path.

Each public op here dispatches on the device of its inputs, in one place per op; the
CUDA-only modules (FLA, Triton) are imported lazily so that CPU paths import cleanly.
"""

import os

# FLA routes each of its ops through a backend dispatcher (a loop over optional TileLang /
# FlashQLA / Ascend backends inside a torch.compiler.disable wrapper) on every call, several
# times per GDN prefill call; deltaserve uses its Triton kernels only. Set before FLA is first
# imported (here, or by transformers), it makes FLA bind its functions directly.
# DELTASERVE_FLA_DIRECT=0 keeps FLA's dispatch and public entry points (kernels/gdn_cuda.py).
if os.environ.get("DELTASERVE_FLA_DIRECT", "1") != "0":
    os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")

from deltaserve.kernels.attention import paged_attention, store_kv  # noqa: E402
from deltaserve.kernels.conv import conv_decode, conv_prefill  # noqa: E402
from deltaserve.kernels.gdn import gdn_decode, gdn_prefill  # noqa: E402

__all__ = ["conv_decode", "conv_prefill", "gdn_decode", "gdn_prefill", "paged_attention", "store_kv"]
