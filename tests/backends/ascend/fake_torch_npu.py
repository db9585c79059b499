"""A stand-in for the `torch_npu` module, in plain torch on CPU, written from torch_npu's and CANN's documentation.

It implements exactly the nine torch_npu ops the ascend950 backend calls, with the Python signatures of
torch_npu 2.13's schema (npu_native_functions_by_codegen.yaml; `Tensor self` is `input`, as PyTorch's
Python bindings name it), computes in float32 and returns the input's dtype. It is for glue tests: it
checks the arguments the documentation constrains and raises `DocViolation` for combinations the
documentation forbids, so that misuse by the backend shows on CPU. It is NOT evidence that the backend
runs on Ascend hardware, and where the documentation is silent it says so (ASSUMPTION in the docstrings).

Sources (the hiascend.com pages mirror the op-plugin Markdown):
  [PTA]  torch_npu API docs, Ascend/op-plugin docs/context/torch_npu-<op>.md (Atlas A2/A3 products);
         hiascend.com ptaoplist_* pages for npu_swiglu, npu_rms_norm, npu_scatter_nd_update_.
  [OPS]  CANN ops-transformer docs, which list Ascend 950: moe/moe_gating_top_k/docs/aclnnMoeGatingTopK.md
         (+ tests/assets/golden.py), attention/fused_infer_attention_score/docs/
         aclnnFusedInferAttentionScoreV5.md (the only FIA version documented for Ascend 950; V3/V4 say
         "Ascend 950PR/Ascend 950DT: 不支持"), mc2/moe_distribute_dispatch/docs/aclnnMoeDistributeDispatch.md.
  [META] torch_npu 2.13 op_plugin/meta/_meta_registrations.py (output shapes and dtypes).

Checks come in two layers:
  * always: what the documentation states for every product (dtypes, shapes, required arguments,
    contiguity where the docs say "不支持非连续", value ranges, sparse_mode 3 needs the 2048 x 2048 mask);
  * `profile="ascend950"` / `profile="atlas_a2_a3"`: the documented size limits of those products
    (head dims, Q_S, BS, H, K, block sizes), which the small shapes of most glue tests would not meet.
`allow_float32_attention=True` lets npu_fused_infer_attention_score take float32 (the docs allow only
float16/bfloat16; the backend's Capabilities never offer float32, so this relaxation only serves the
float32 end-to-end comparison with the cpu backend).

The op implementations live next to this module, one file per op family, as functions that FakeTorchNpu
binds as its methods: fake_npu_dense.py (npu_rms_norm, npu_rotary_mul, npu_swiglu, npu_scatter_nd_update_),
fake_npu_moe.py (npu_moe_gating_top_k, npu_grouped_matmul), fake_npu_attention.py
(npu_fused_infer_attention_score), fake_npu_mc2.py (npu_moe_distribute_dispatch / _combine); their shared
checks and DocViolation are in fake_npu_common.py.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import fake_npu_attention
import fake_npu_dense
import fake_npu_mc2
import fake_npu_moe
from fake_npu_common import DocViolation

__all__ = ["DocViolation", "FakeTorchNpu", "IMPLEMENTED_OPS", "PROFILES", "expect_violation"]

IMPLEMENTED_OPS = (
    "npu_rms_norm",
    "npu_rotary_mul",
    "npu_swiglu",
    "npu_moe_gating_top_k",
    "npu_grouped_matmul",
    "npu_scatter_nd_update_",
    "npu_fused_infer_attention_score",
    "npu_moe_distribute_dispatch",
    "npu_moe_distribute_combine",
)
PROFILES = (None, "ascend950", "atlas_a2_a3")


@contextmanager
def expect_violation(pattern: str):
    """For xfail(raises=DocViolation) tests: only the DocViolation whose message matches `pattern` gets through,
    so the test documents that one limit and fails on any other."""
    try:
        yield
    except DocViolation as err:
        if not re.search(pattern, str(err)):
            raise AssertionError(f"a different documented limit was hit: {err}") from err
        raise


@dataclass
class Call:
    op: str
    args: dict[str, Any] = field(default_factory=dict)


class FakeTorchNpu:
    """Module-like: `FakeTorchNpu().npu_rms_norm(...)` as `torch_npu.npu_rms_norm(...)`. Every call is recorded
    in `calls` (op name and arguments by name) so tests can inspect what the backend passed."""

    __name__ = "fake_torch_npu"

    def __init__(self, *, profile: str | None = None, allow_float32_attention: bool = False) -> None:
        if profile not in PROFILES:
            raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
        self.profile = profile
        self.allow_float32_attention = allow_float32_attention
        self.calls: list[Call] = []

    def calls_of(self, op: str) -> list[Call]:
        return [c for c in self.calls if c.op == op]

    def _record(self, op: str, args: dict[str, Any]) -> None:
        self.calls.append(Call(op, {k: v for k, v in args.items() if k != "self"}))

    # the ops, one module per family; bound here (not inherited from mixins) so that they are the class's own
    # attributes, as vars(FakeTorchNpu) in test_fake_torch_npu.py expects

    npu_rms_norm = fake_npu_dense.npu_rms_norm
    npu_rotary_mul = fake_npu_dense.npu_rotary_mul
    npu_swiglu = fake_npu_dense.npu_swiglu
    npu_scatter_nd_update_ = fake_npu_dense.npu_scatter_nd_update_

    npu_moe_gating_top_k = fake_npu_moe.npu_moe_gating_top_k
    npu_grouped_matmul = fake_npu_moe.npu_grouped_matmul

    npu_fused_infer_attention_score = fake_npu_attention.npu_fused_infer_attention_score

    npu_moe_distribute_dispatch = fake_npu_mc2.npu_moe_distribute_dispatch
    npu_moe_distribute_combine = fake_npu_mc2.npu_moe_distribute_combine
