"""The fake torch_npu itself: its Python signatures are torch_npu 2.13's schema, it implements exactly the ops the
ascend950 backend calls, and its documented argument checks fire. (The fake's arithmetic is checked by the
glue tests, which compare the backend running on it with core's reference implementations.)"""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import yaml
from fake_torch_npu import IMPLEMENTED_OPS, DocViolation, FakeTorchNpu
from torchgen.model import FunctionSchema

import deepinfer_ascend950

TORCH_NPU_VERSION = "2.13.0"
WHEEL_CACHE = Path.home() / ".cache" / "deepinfer" / "torch_npu" / TORCH_NPU_VERSION
YAML_IN_WHEEL = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
EXTRACTED_YAML = Path("/tmp/npuwheel") / YAML_IN_WHEEL


@pytest.fixture(scope="module")
def schema_yaml() -> str:
    """torch_npu 2.13.0's op schema yaml: from the cached wheel, else an extracted copy, else a pip download."""
    wheels = sorted(WHEEL_CACHE.glob(f"torch_npu-{TORCH_NPU_VERSION}-*.whl"))
    if not wheels and EXTRACTED_YAML.is_file():
        return EXTRACTED_YAML.read_text()
    if not wheels:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--retries", "1", "--timeout", "20"]
        command += [f"torch-npu=={TORCH_NPU_VERSION}", "-d", str(WHEEL_CACHE)]
        try:
            subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as err:
            detail = getattr(err, "stderr", None) or str(err)
            pytest.skip(f"torch_npu {TORCH_NPU_VERSION} wheel not cached and not downloadable: {detail.strip()[-300:]}")
        wheels = sorted(WHEEL_CACHE.glob(f"torch_npu-{TORCH_NPU_VERSION}-*.whl"))
        if not wheels:
            pytest.skip(f"pip download left no torch_npu {TORCH_NPU_VERSION} wheel in {WHEEL_CACHE}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        return wheel.read(YAML_IN_WHEEL).decode()


@pytest.fixture(scope="module")
def schema_sections(schema_yaml) -> dict:
    return yaml.safe_load(schema_yaml)


def schema_line(sections: dict, name: str) -> str:
    """The one `func:` line of op `name` (default overload); the yaml lists some ops in several sections."""
    lines = {
        entry["func"]
        for section in sections.values()
        if isinstance(section, list)
        for entry in section
        if isinstance(entry, dict) and entry.get("func", "").split("(")[0] == name
    }
    assert len(lines) == 1, f"{name}: expected one schema, found {sorted(lines)}"
    return lines.pop()


_NO_DEFAULT = object()


def expected_parameters(schema: FunctionSchema) -> list[tuple[str, inspect._ParameterKind, object]]:
    """(name, kind, default) per argument as PyTorch's Python binding exposes it: `Tensor self` is `input`."""
    expected = []
    for kind, args in (
        (inspect.Parameter.POSITIONAL_OR_KEYWORD, schema.arguments.flat_positional),
        (inspect.Parameter.KEYWORD_ONLY, schema.arguments.flat_kwarg_only),
    ):
        for arg in args:
            name = "input" if arg.name == "self" and str(arg.type) == "Tensor" else arg.name
            default = _NO_DEFAULT if arg.default is None else ast.literal_eval(arg.default)
            expected.append((name, kind, default))
    return expected


def actual_parameters(fn) -> list[tuple[str, inspect._ParameterKind, object]]:
    params = inspect.signature(fn).parameters.values()
    return [(p.name, p.kind, _NO_DEFAULT if p.default is inspect.Parameter.empty else p.default) for p in params]


def test_the_fake_implements_exactly_the_ops_the_backend_calls():
    package = Path(deepinfer_ascend950.__file__).parent
    called = set()
    for source in package.glob("*.py"):
        called |= set(re.findall(r"\bnpu\.(npu_\w+)\s*\(", source.read_text()))
    assert called == set(IMPLEMENTED_OPS)
    public = {name for name in vars(FakeTorchNpu) if name.startswith("npu_")}
    assert public == set(IMPLEMENTED_OPS)


@pytest.mark.parametrize("op", IMPLEMENTED_OPS)
def test_fake_signature_matches_the_torch_npu_schema(schema_sections, op):
    line = schema_line(schema_sections, op)
    schema = FunctionSchema.parse(line)
    assert not schema.arguments.out, "the default overload has no out= arguments"
    fn = getattr(FakeTorchNpu(), op)
    actual, expected = actual_parameters(fn), expected_parameters(schema)
    assert [a[:2] for a in actual] == [e[:2] for e in expected], "names, order or positional/keyword-only split differ"
    for (name, _, got), (_, _, want) in zip(actual, expected):
        assert (got is _NO_DEFAULT) == (want is _NO_DEFAULT), f"{name}: default presence differs"
        assert got == want and type(got) is type(want), f"{name}: default {got!r} != schema's {want!r}"
    assert inspect.getdoc(fn).splitlines()[0] == line, "the docstring must start with the exact schema line"


# ------------------------------------------------------------------------------------------ documented checks


def _paged_call(npu: FakeTorchNpu, *, dtype=torch.bfloat16, mask="triu", query_view=False, sparse_mode=3):
    """One TND paged attention call of 2 sequences over 3 blocks of 128 (GQA, 4 heads over 2)."""
    g = torch.Generator().manual_seed(0)
    query = torch.randn(5, 4, 16, generator=g).to(dtype)
    if query_view:
        query = torch.randn(5, 4, 24, generator=g).to(dtype)[..., :16]
    key = torch.randn(3, 128, 2 * 16, generator=g).to(dtype)
    triu = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)
    atten_mask = {"triu": triu, "tril": triu.T.contiguous(), None: None}[mask]
    return npu.npu_fused_infer_attention_score(
        query, key, key, atten_mask=atten_mask, actual_seq_lengths=[3, 5], actual_seq_lengths_kv=[130, 40],
        block_table=torch.tensor([[2, 0], [1, -1]], dtype=torch.int32), num_heads=4, num_key_value_heads=2,
        scale=0.25, input_layout="TND", sparse_mode=sparse_mode, block_size=128,
    )  # fmt: skip


def test_fake_attention_matches_a_dense_causal_softmax():
    npu = FakeTorchNpu(allow_float32_attention=True)
    out, lse = _paged_call(npu, dtype=torch.float32)
    call = npu.calls_of("npu_fused_infer_attention_score")[0].args
    q, cache = call["query"], call["key"]
    # sequence 0: 3 queries at positions 127..129 of 130, context in blocks 2 then 0; KV head h // 2
    context = torch.cat([cache[2], cache[0, :2]]).view(130, 2, 16)
    for h in range(4):
        kv = context[:, h // 2]
        scores = (q[:3, h] @ kv.T) * 0.25
        scores[torch.arange(130)[None, :] > torch.arange(127, 130)[:, None]] = float("-inf")
        torch.testing.assert_close(out[:3, h], scores.softmax(-1) @ kv)
    assert lse.shape == (1,) and lse.item() == 0.0  # softmax_lse_flag False: a [1] zero tensor


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(mask=None), "sparse_mode 3 needs"),
        (dict(mask="tril"), "triu"),
        (dict(query_view=True), "query must be contiguous"),
        (dict(dtype=torch.float32), "query dtype"),
        (dict(sparse_mode=2), "sparse_mode 0"),
    ],
    ids=["no_mask", "wrong_mask", "non_contiguous_query", "float32", "sparse_mode_2"],
)
def test_fake_attention_rejects_what_the_docs_forbid(kwargs, message):
    with pytest.raises(DocViolation, match=message):
        _paged_call(FakeTorchNpu(), **kwargs)


def test_fake_ops_reject_what_the_docs_forbid():
    npu, g = FakeTorchNpu(), torch.Generator().manual_seed(1)
    x = torch.randn(6, 8, generator=g)
    with pytest.raises(DocViolation, match="non-contiguous"):
        npu.npu_swiglu(x.T, dim=-1)
    with pytest.raises(DocViolation, match="gamma dtype"):
        npu.npu_rms_norm(x.bfloat16(), torch.ones(8), epsilon=1e-6)
    weight = torch.randn(3, 8, 4, generator=g)
    with pytest.raises(DocViolation, match="sum to"):
        npu.npu_grouped_matmul(
            [x], [weight], group_list=torch.tensor([2, 2, 1]), split_item=3, group_type=0, group_list_type=1
        )
    with pytest.raises(DocViolation, match="length 1"):
        npu.npu_grouped_matmul(
            [x], [weight[:1]], group_list=torch.tensor([6]), split_item=3, group_type=0, group_list_type=1
        )
    with pytest.raises(DocViolation, match="updates dtype"):
        npu.npu_scatter_nd_update_(torch.zeros(4, 8), torch.tensor([[1]]), torch.ones(1, 8, dtype=torch.bfloat16))
    with pytest.raises(DocViolation, match="bias dtype"):
        npu.npu_moe_gating_top_k(x, 2, bias=torch.zeros(8, dtype=torch.bfloat16))
    with pytest.raises(DocViolation, match="rotary_mode"):
        npu.npu_rotary_mul(x.view(1, 6, 1, 8), torch.ones(1, 6, 1, 8), torch.ones(1, 6, 1, 8), "rotate_half")
    ids = torch.tensor([[0, 1], [2, 2], [3, 0], [1, 3], [0, 2], [1, 2]], dtype=torch.int32)
    with pytest.raises(DocViolation, match="x dtype"):
        npu.npu_moe_distribute_dispatch(x, ids, "ep", 1, 0, 4)
    with pytest.raises(DocViolation, match="must differ"):
        npu.npu_moe_distribute_dispatch(x.bfloat16(), ids, "ep", 1, 0, 4)
    ids[1, 1] = 1
    expand_x, _, expand_idx, expert_token_nums, ep_recv_counts, _, _ = npu.npu_moe_distribute_dispatch(
        x.bfloat16(), ids, "ep", 1, 0, 4
    )
    scales = torch.rand(6, 2, generator=g)
    npu.npu_moe_distribute_combine(expand_x, ids, expand_idx, ep_recv_counts, scales, "ep", 1, 0, 4)
    with pytest.raises(DocViolation, match="ep_recv_counts"):
        npu.npu_moe_distribute_combine(expand_x, ids, expand_idx, expert_token_nums.int(), scales, "ep", 1, 0, 4)
