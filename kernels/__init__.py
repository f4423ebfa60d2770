"""Every op twice: a plain-torch reference (CPU, the oracle) and a fast CUDA path.

Each public op here dispatches on the device of its inputs, in one place per op; the
CUDA-only modules (FLA, Triton) are imported lazily so that CPU paths import cleanly.
"""

from deltaserve.kernels.attention import paged_attention, store_kv
from deltaserve.kernels.conv import conv_decode, conv_prefill
from deltaserve.kernels.gdn import gdn_decode, gdn_prefill

__all__ = ["conv_decode", "conv_prefill", "gdn_decode", "gdn_prefill", "paged_attention", "store_kv"]
