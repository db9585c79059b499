"""Checks that every torch_npu op call in the ascend950 backend names a real op and binds its arguments.

Schemas come from the torch_npu wheel's npu_native_functions_by_codegen.yaml (parsed with torchgen, which
ships in torch), calls from the backend's source (`ast`). Imports neither torch_npu nor torch.
Run: python backends/ascend950/tools/npu_schema_check.py [PATH] [--torch-npu-version X]
"""

from __future__ import annotations

import argparse
import ast
import difflib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from torchgen.model import FunctionSchema

SCHEMA_MEMBER = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
BACKEND_DIR = Path(__file__).resolve().parents[1] / "deepinfer_ascend950"
OP_PREFIXES = ("npu_", "_npu_")
FALLBACK_PYTHON = "3.11"  # the yaml is the same in every Python tag's wheel; cp311 wheels are always published
DOWNLOAD_TIMEOUT_S = 300
_FUNC_LINE = re.compile(r"^\s*(?:-\s+)?func:\s*(\S.*?)\s*$")  # `- func: ...` or `  func: ...` under other keys


class SchemasUnavailable(Exception):
    """The torch_npu op schemas could not be obtained; `reason` says why, for a skip message."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Call:
    """One call of a torch_npu op, as written in the source."""

    file: str
    line: int
    op: str  # "npu_rms_norm", "npu_scatter_nd_update_"
    overload: str | None  # only for torch.ops.npu.<op>.<overload>(...): "" is the default overload
    num_positional: int  # positional arguments written out; a *starred one is not counted
    keywords: tuple[str, ...]
    has_star_args: bool  # *args: more positional arguments than counted, how many is unknown
    has_star_kwargs: bool  # **kwargs: more keyword arguments, which ones is unknown


def torch_release() -> str:
    """The installed torch's major.minor.patch ('2.13.0+cpu' -> '2.13.0'): the matching torch_npu version."""
    version = metadata.version("torch")
    match = re.match(r"\d+\.\d+\.\d+", version)
    if match is None:
        raise SchemasUnavailable(f"cannot derive a torch_npu version from torch {version}; pass --torch-npu-version")
    return match.group(0)


def default_cache_dir() -> Path:
    return Path(os.environ.get("DEEPINFER_CACHE") or Path.home() / ".cache" / "deepinfer")


def fetch_schemas(torch_npu_version: str, cache_dir: str | Path | None = None) -> Path:
    """Path to torch_npu==version's op-schema yaml in <cache_dir>/torch_npu/<version>/, downloading the wheel
    (only the yaml is kept) on the first call. Raises SchemasUnavailable when pip cannot get the wheel."""
    target = Path(cache_dir or default_cache_dir()) / "torch_npu" / torch_npu_version
    yaml_path = target / Path(SCHEMA_MEMBER).name
    if yaml_path.is_file():
        return yaml_path
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target) as download_dir:
        wheel = _download_wheel(torch_npu_version, Path(download_dir))
        try:
            with zipfile.ZipFile(wheel) as archive:
                data = archive.read(SCHEMA_MEMBER)
        except (zipfile.BadZipFile, KeyError) as err:
            raise SchemasUnavailable(f"{wheel.name} has no readable {SCHEMA_MEMBER} ({err})") from err
    partial = target / f"{yaml_path.name}.{os.getpid()}.partial"
    partial.write_bytes(data)
    (target / "source.txt").write_text(f"{wheel.name}\n")
    os.replace(partial, yaml_path)  # atomic: a parallel run never reads half a file
    return yaml_path


def _download_wheel(version: str, into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet"]
    command += ["--timeout", "30", "--retries", "1", "--dest", str(into), f"torch-npu=={version}"]
    attempts = [command]
    if sys.version_info[:2] != tuple(map(int, FALLBACK_PYTHON.split("."))):
        attempts.append([*command, "--python-version", FALLBACK_PYTHON])  # no wheel for this Python's tag
    errors = []
    for attempt in attempts:
        try:
            result = subprocess.run(attempt, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            errors.append(f"pip download timed out after {DOWNLOAD_TIMEOUT_S} s")
            continue
        wheels = sorted(into.glob("torch_npu-*.whl"))
        if result.returncode == 0 and wheels:
            return wheels[0]
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        errors.append(next((line for line in reversed(lines) if line.startswith("ERROR")), lines[-1] if lines else ""))
    raise SchemasUnavailable(
        f"could not download torch-npu=={version} with pip: {'; '.join(errors)}. Check the network or package "
        f"index, or pass --schemas PATH to a copy of {Path(SCHEMA_MEMBER).name}"
    )


def load_schemas(yaml_path: str | Path) -> dict[str, FunctionSchema]:
    """{op: default overload, "op.overload": that overload} for every `func:` schema in the yaml. An op with
    no default overload maps to its first overload. Bare aten names (no argument list) are skipped."""
    schemas: dict[str, FunctionSchema] = {}
    for number, line in enumerate(Path(yaml_path).read_text().splitlines(), 1):
        match = _FUNC_LINE.match(line)
        if match is None or "(" not in match.group(1):
            continue
        try:
            schema = FunctionSchema.parse(match.group(1))
        except Exception as err:
            raise ValueError(f"{yaml_path}:{number}: torchgen cannot parse this schema ({err}): {line}") from err
        base, overload = str(schema.name.name), schema.name.overload_name
        existing = schemas.get(base)
        if existing is None or (existing.name.overload_name and not overload):
            schemas[base] = schema
        if overload:
            schemas.setdefault(f"{base}.{overload}", schema)
    return schemas


def _op_of(func: ast.expr) -> tuple[str, str | None] | None:
    """(op, overload) when `func` names a torch_npu op: `<anything>.npu_x` or `torch.ops.npu.npu_x.<overload>`."""
    if not isinstance(func, ast.Attribute):
        return None
    if func.attr.startswith(OP_PREFIXES):
        return func.attr, None
    owner = func.value
    if isinstance(owner, ast.Attribute) and owner.attr.startswith(OP_PREFIXES):
        if ast.unparse(owner.value).endswith("ops.npu"):
            return owner.attr, "" if func.attr == "default" else func.attr
    return None


def _dict_keys(value: ast.expr) -> tuple[str, ...] | None:
    """The keys of `dict(a=..., b=...)` or `{"a": ..., "b": ...}`; None for anything else."""
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "dict" and not value.args:
        keys = [kw.arg for kw in value.keywords]
    elif isinstance(value, ast.Dict):
        keys = [key.value if isinstance(key, ast.Constant) else None for key in value.keys]
    else:
        return None
    return tuple(keys) if all(isinstance(key, str) for key in keys) else None


def _spread_dicts(tree: ast.AST) -> dict[str, tuple[str, ...]]:
    """What `**name` passes, for each name bound once in the file, to a literal dict, and used only as
    `**name`; any other binding or use of the name (a parameter, an update, a read) leaves it unknown."""
    spread = {id(kw.value) for node in ast.walk(tree) if isinstance(node, ast.Call) for kw in node.keywords}
    bindings: dict[str, int] = {}
    literal, other_uses = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) or (isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load)):
            name = node.arg if isinstance(node, ast.arg) else node.id
            bindings[name] = bindings.get(name, 0) + 1
        elif isinstance(node, ast.Name) and id(node) not in spread:
            other_uses.add(node.id)
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if (keys := _dict_keys(node.value)) is not None:
                literal[node.targets[0].id] = keys
    return {name: keys for name, keys in literal.items() if bindings[name] == 1 and name not in other_uses}


def _call(file: Path, node: ast.Call, op: str, overload: str | None, spread_dicts: dict) -> Call:
    starred = [isinstance(arg, ast.Starred) for arg in node.args]
    keywords, unknown_spread = [], False
    for kw in node.keywords:
        if kw.arg is not None:
            keywords.append(kw.arg)
        elif isinstance(kw.value, ast.Name) and kw.value.id in spread_dicts:
            keywords += spread_dicts[kw.value.id]
        else:
            unknown_spread = True
    counts = dict(num_positional=starred.count(False), has_star_args=any(starred), has_star_kwargs=unknown_spread)
    return Call(str(file), node.lineno, op, overload, keywords=tuple(keywords), **counts)


def find_npu_calls(path: str | Path) -> list[Call]:
    """Every call of a torch_npu op in a .py file, or in the .py files under a directory. A `**name` of a
    literal dict (`common = dict(group_type=0)`) counts as its keys; any other `**` as unknown keywords."""
    path = Path(path)
    calls = []
    for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
        tree = ast.parse(file.read_text(), filename=str(file))
        spread_dicts = _spread_dicts(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (named := _op_of(node.func)) is not None:
                calls.append(_call(file, node, *named, spread_dicts))
    return sorted(calls, key=lambda call: (call.file, call.line))


def _did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=3)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def _bind(call: Call, schema: FunctionSchema) -> list[str]:
    """Problems binding the call's arguments to one overload, as Python's argument parser would."""
    op, args = str(schema.name), schema.arguments
    positional = list(args.flat_positional)
    keyword_only = [*args.flat_kwarg_only, *args.out]
    by_name = {param.name: param for param in positional + keyword_only}
    problems = []
    if call.num_positional > len(positional):
        takes = f"{op} takes {len(positional)} positional arguments ({', '.join(p.name for p in positional)})"
        rest = f": the rest are keyword-only ({', '.join(p.name for p in keyword_only[:4])}, ...), pass them by name"
        problems.append(f"{takes}, got {call.num_positional}{rest if keyword_only else ''}")
    bound = {param.name for param in positional[: call.num_positional]}
    for keyword in call.keywords:
        if keyword == "out" and args.out and "out" not in by_name:
            bound |= {param.name for param in args.out}  # Python bindings take the out tensors as one out=
            continue
        name = "self" if keyword == "input" and "input" not in by_name else keyword  # Python spells self `input`
        if name not in by_name:
            problems.append(f"{op} has no argument {keyword!r}{_did_you_mean(keyword, by_name)}")
        elif name in bound:
            problems.append(f"{op}'s {name!r} is passed twice: positionally and as {keyword}=")
        else:
            bound.add(name)
    unknown = set(by_name) if call.has_star_kwargs else {p.name for p in positional} if call.has_star_args else set()
    missing = [p.name for p in positional + keyword_only if p.default is None and p.name not in bound | unknown]
    if missing:
        problems.append(f"{op} requires {', '.join(missing)} (no default), not passed")
    return problems


def check_call(call: Call, schemas: dict[str, FunctionSchema]) -> list[str]:
    """Why the call cannot bind to torch_npu's op: [] when it binds to the op or any of its overloads."""
    overloads = {str(s.name): s for key, s in schemas.items() if key.split(".")[0] == call.op}
    if not overloads:
        ops = {key.split(".")[0] for key in schemas}
        return [f"{call.op} is not an op of this torch_npu{_did_you_mean(call.op, ops)}"]
    candidates = sorted(overloads.values(), key=lambda s: s.name.overload_name != "")  # the default first
    if call.overload is not None:
        candidates = [s for s in candidates if s.name.overload_name == call.overload]
        if not candidates:
            return [f"{call.op} has no overload {call.overload!r} (it has: {', '.join(sorted(overloads))})"]
    attempts = [_bind(call, schema) for schema in candidates]
    if any(not problems for problems in attempts):
        return []
    return min(attempts, key=lambda problems: (sum("has no argument" in p for p in problems), len(problems)))


def check_tree(path: str | Path, schemas: dict[str, FunctionSchema]) -> tuple[list[Call], list[str]]:
    """All torch_npu op calls under `path`, and their problems as 'file:line: problem'."""
    calls = find_npu_calls(path)
    return calls, [f"{call.file}:{call.line}: {problem}" for call in calls for problem in check_call(call, schemas)]


def _shown(file: str) -> str:
    try:
        return str(Path(file).resolve().relative_to(Path.cwd()))
    except ValueError:
        return file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", type=Path, default=BACKEND_DIR, help="a .py file or directory of them")
    parser.add_argument("--torch-npu-version", help="default: the installed torch's major.minor.patch")
    parser.add_argument("--cache-dir", type=Path, help="default: $DEEPINFER_CACHE or ~/.cache/deepinfer")
    parser.add_argument("--schemas", type=Path, help=f"a {Path(SCHEMA_MEMBER).name} to use instead of downloading")
    options = parser.parse_args(argv)
    if not options.path.exists():
        parser.error(f"{options.path} does not exist: give a .py file or a directory of them")
    try:
        version = options.torch_npu_version or torch_release()
        yaml_path = options.schemas or fetch_schemas(version, options.cache_dir)
    except SchemasUnavailable as err:
        print(f"npu schema check not run: {err.reason}", file=sys.stderr)
        return 2
    schemas = load_schemas(yaml_path)
    calls = find_npu_calls(options.path)
    failed = 0
    for call in calls:
        problems = check_call(call, schemas)
        failed += bool(problems)
        print(f"{_shown(call.file)}:{call.line:<5} {call.op:<36} {'; '.join(problems) or 'ok'}")
    print(f"{len(calls)} torch_npu op calls checked against {yaml_path}: {failed} with problems")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
