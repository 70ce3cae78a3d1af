"""Tree-decoder hot path: each Triton kernel beside its PyTorch reference.

`name(...)` runs the Triton kernel when the inputs are on CUDA and
`EAGLETOOLS_KERNELS` is not `reference`, else `name_reference(...)`
(`EAGLETOOLS_KERNELS=triton` forces the kernels, see `dispatch.use_triton`).
"""

from eagletools.kernels.attention import tree_attention, tree_attention_reference
from eagletools.kernels.dispatch import use_triton
from eagletools.kernels.draft_topk import topk_d2t, topk_d2t_reference
from eagletools.kernels.greedy_verify import verify_greedy, verify_greedy_reference
from eagletools.kernels.kv_compact import compact_kv, compact_kv_reference
from eagletools.kernels.sampling_verify import verify_sampling, verify_sampling_reference

__all__ = [
    "compact_kv",
    "compact_kv_reference",
    "topk_d2t",
    "topk_d2t_reference",
    "tree_attention",
    "tree_attention_reference",
    "verify_greedy",
    "verify_greedy_reference",
    "use_triton",
    "verify_sampling",
    "verify_sampling_reference",
]
