"""The schema check's parts on handwritten inputs: the yaml parser, the call finder, the binder, the cache
and download, the CLI. None of these needs the real wheel or the network."""

from __future__ import annotations

import subprocess
import textwrap
import zipfile

import npu_schema_check as check
import pytest

# Lines as the wheel writes them: top-level `- func:`, `func:` under other keys, an overload listed
# before its default, a repeated op, an op with only an overload, and bare aten names with no schema.
SCHEMAS_YAML = """\
backend: NPU
custom:
- func: npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)
- device_check: NoCheck
  exposed: true
  func: npu_swiglu(Tensor self, int dim=-1) -> Tensor
- func: npu_fused_infer_attention_score.out(Tensor query, Tensor key, Tensor value, *, int num_heads=1, \
str input_layout="BSH", Tensor? workspace=None, Tensor(a!) attention_out, Tensor(b!) softmax_lse) -> \
(Tensor(a!), Tensor(b!))
- func: npu_fused_infer_attention_score(Tensor query, Tensor key, Tensor value, *, Tensor? pse_shift=None, \
int num_heads=1, str input_layout="BSH") -> (Tensor, Tensor)
  impl_ns: op_api
- func: npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)
- func: npu_scatter_nd_update_(Tensor(a!) self, Tensor indices, Tensor updates) -> Tensor(a!)
- func: npu_moe_finalize_routing(Tensor expanded_permuted_rows, Tensor? skip1, Tensor? skip2, Tensor? bias, \
Tensor? scales, Tensor expanded_src_to_dst_row, Tensor? export_for_source_row, int? drop_pad_mode=0) -> Tensor
- func: _npu_format_cast.aclnn(Tensor self, int acl_format, int customize_dtype) -> Tensor
supported:
- clone
- func: copy_
"""


@pytest.fixture
def schemas_yaml(tmp_path):
    path = tmp_path / "npu_native_functions_by_codegen.yaml"
    path.write_text(SCHEMAS_YAML)
    return path


@pytest.fixture
def schemas(schemas_yaml):
    return check.load_schemas(schemas_yaml)


def _calls(tmp_path, source: str) -> list[check.Call]:
    path = tmp_path / "snippet.py"
    path.write_text(textwrap.dedent(source))
    return check.find_npu_calls(path)


def test_parser_reads_top_level_indented_and_overload_entries(schemas):
    assert set(schemas) == {
        "npu_rms_norm",
        "npu_swiglu",  # its `func:` is indented under other keys
        "npu_fused_infer_attention_score",
        "npu_fused_infer_attention_score.out",
        "npu_scatter_nd_update_",
        "npu_moe_finalize_routing",
        "_npu_format_cast",
        "_npu_format_cast.aclnn",
    }  # `clone` and `copy_` have no schema here: skipped
    swiglu = schemas["npu_swiglu"].arguments
    assert [(a.name, a.default) for a in swiglu.flat_positional] == [("self", None), ("dim", "-1")]


def test_parser_maps_the_plain_name_to_the_default_overload(schemas):
    assert schemas["npu_fused_infer_attention_score"].name.overload_name == ""  # though .out comes first
    out = schemas["npu_fused_infer_attention_score.out"].arguments
    assert [a.name for a in out.flat_positional] == ["query", "key", "value"]
    assert [a.name for a in out.out] == ["attention_out", "softmax_lse"]
    assert str(schemas["_npu_format_cast"].name) == "_npu_format_cast.aclnn"  # no default: its only overload


def test_finder_reads_op_calls_and_nothing_else(tmp_path):
    calls = _calls(
        tmp_path,
        """
        def f(self, npu, x, w, args, kwargs):
            torch_npu.npu_rms_norm(x, w, epsilon=1e-6)
            self.npu.npu_swiglu(x, dim=-1)
            npu.npu_grouped_matmul([x], [w], *args, **kwargs)
            torch.ops.npu.npu_rms_norm.default(x, w)
            torch_npu._npu_format_cast(x, 2)
            torch.npu.synchronize()
            torch_npu.npu.current_stream()
        """,
    )
    assert [(c.line, c.op, c.overload, c.num_positional, c.keywords) for c in calls] == [
        (3, "npu_rms_norm", None, 2, ("epsilon",)),
        (4, "npu_swiglu", None, 1, ("dim",)),
        (5, "npu_grouped_matmul", None, 2, ()),
        (6, "npu_rms_norm", "", 2, ()),
        (7, "_npu_format_cast", None, 2, ()),
    ]
    assert (calls[2].has_star_args, calls[2].has_star_kwargs) == (True, True)
    assert not any(c.has_star_args or c.has_star_kwargs for c in calls[:2] + calls[3:])


def test_finder_counts_a_literal_dict_spread_as_its_keys(tmp_path):
    calls = _calls(
        tmp_path,
        """
        def f(npu, x, w, n):
            common = dict(group_list=n, split_item=3)
            npu.npu_grouped_matmul([x], [w], **common)
            changed = {"group_list": n}
            changed["group_type"] = 0
            npu.npu_grouped_matmul([x], [w], **changed)
        """,
    )
    assert (calls[0].keywords, calls[0].has_star_kwargs) == (("group_list", "split_item"), False)
    assert (calls[1].keywords, calls[1].has_star_kwargs) == ((), True)  # changed after: unknown


@pytest.mark.parametrize(
    "source, problem",
    [
        ("npu.npu_rms_norm(x, w, epsilon=1e-6)", None),
        ("npu.npu_rms_norm(input=x, gamma=w)", None),  # Python bindings spell a Tensor `self` as `input`
        ("npu.npu_scatter_nd_update_(cache, index, rows)", None),
        ("npu.npu_fused_infer_attention_score(q, k, v, num_heads=2, out=(o, lse))", None),  # the .out overload
        ("torch.ops.npu.npu_fused_infer_attention_score.out(q, k, v, attention_out=o, softmax_lse=lse)", None),
        ("torch.ops.npu.npu_rms_norm.default(x, w)", None),
        ("npu.npu_rms_norm(*args)", None),  # *args may hold gamma
        ("npu.npu_rms_norm(x, **kwargs)", None),  # **kwargs may hold gamma
        ("npu.npu_rms_nrom(x, w)", "npu_rms_nrom is not an op of this torch_npu; did you mean npu_rms_norm?"),
        ("npu.npu_rms_norm(x, w, 1e-6, 2)", "npu_rms_norm takes 3 positional arguments (self, gamma, epsilon), got 4"),
        ("npu.npu_fused_infer_attention_score(q, k, v, m)", "got 4: the rest are keyword-only (pse_shift, num_heads"),
        ("npu.npu_rms_norm(x, w, epsilom=1e-6)", "npu_rms_norm has no argument 'epsilom'; did you mean epsilon?"),
        ("npu.npu_rms_norm(x, **kwargs, epsilom=1e-6)", "no argument 'epsilom'"),
        ("npu.npu_rms_norm(x, w, gamma=w)", "npu_rms_norm's 'gamma' is passed twice"),
        ("npu.npu_rms_norm(x)", "npu_rms_norm requires gamma (no default), not passed"),
        ("npu.npu_moe_finalize_routing(r, None, None, None, s, i)", "requires export_for_source_row"),
        ("npu.npu_fused_infer_attention_score(q, k, v, attention_out=o)", "requires softmax_lse"),
        ("torch.ops.npu.npu_rms_norm.out(x, w)", "npu_rms_norm has no overload 'out'"),
    ],
)
def test_check_call(source, problem, schemas, tmp_path):
    [call] = _calls(tmp_path, source)
    problems = check.check_call(call, schemas)
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0], problems


def test_a_cached_schema_file_is_used_without_downloading(tmp_path, monkeypatch):
    cached = tmp_path / "torch_npu" / "9.9.9" / "npu_native_functions_by_codegen.yaml"
    cached.parent.mkdir(parents=True)
    cached.write_text(SCHEMAS_YAML)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("downloaded although the yaml is cached"))
    assert check.fetch_schemas("9.9.9", tmp_path) == cached


def _offline_index(monkeypatch, wheels_dir):
    """pip sees only the wheels in `wheels_dir`: no network, no index."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels_dir))


def test_the_schemas_are_extracted_from_the_downloaded_wheel_and_only_they_are_kept(tmp_path, monkeypatch):
    wheels = tmp_path / "index"
    wheels.mkdir()
    dist_info = {
        "METADATA": "Metadata-Version: 2.1\nName: torch-npu\nVersion: 9.9.9\n",
        "WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        "RECORD": "",
    }
    with zipfile.ZipFile(wheels / "torch_npu-9.9.9-py3-none-any.whl", "w") as wheel:
        wheel.writestr(check.SCHEMA_MEMBER, SCHEMAS_YAML)
        for name, text in dist_info.items():
            wheel.writestr(f"torch_npu-9.9.9.dist-info/{name}", text)
    _offline_index(monkeypatch, wheels)
    yaml_path = check.fetch_schemas("9.9.9", tmp_path / "cache")
    assert yaml_path.read_text() == SCHEMAS_YAML
    assert sorted(p.name for p in yaml_path.parent.iterdir()) == [yaml_path.name, "source.txt"]


def test_a_failed_download_says_why(tmp_path, monkeypatch):
    _offline_index(monkeypatch, tmp_path)
    with pytest.raises(check.SchemasUnavailable, match=r"could not download torch-npu==9\.9\.9 with pip: .*9\.9\.9"):
        check.fetch_schemas("9.9.9", tmp_path / "cache")
    assert check.main(["--torch-npu-version", "9.9.9", "--cache-dir", str(tmp_path / "cache")]) == 2


def test_cli_exit_status_follows_the_problems(schemas_yaml, tmp_path, capsys):
    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_text("npu.npu_rms_norm(x, w)\n")
    bad.write_text("npu.npu_rms_norm(x, w)\nnpu.npu_rms_norm(x, w, epsilom=1e-6)\n")
    assert check.main([str(good), "--schemas", str(schemas_yaml)]) == 0
    assert check.main([str(bad), "--schemas", str(schemas_yaml)]) == 1
    assert "2 torch_npu op calls checked" in capsys.readouterr().out
