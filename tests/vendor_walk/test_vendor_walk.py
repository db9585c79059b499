"""docs/vendor-guide.md followed literally, from zero, as a vendor would: every step must work as written.

The guide's code blocks titled with a path (```toml title="pyproject.toml"```) are the files of the vendor's
repository; its `console` blocks are the commands, run in that repository in order (a block titled "in
DeepInfer's repository" needs a DeepInfer checkout, tox and the network: its tox.ini side is checked
instead). The commands run in a fresh venv that sees this environment's packages through a .pth file, so
`pip install -e` really installs the vendor's package, nothing is installed into the environment other
tests run in (deleting the venv uninstalls it), and nothing needs the network. `pip`, `deepinfer` and
`pytest` in that venv are console scripts written as pip writes them. One adjustment keeps CI fast: the
conformance commands run part of the suite (SUBSET, SMOKE).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import venv
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
GUIDE = ROOT / "docs" / "vendor-guide.md"
NOT_WALKED = "in DeepInfer's repository"  # title of console blocks run elsewhere (checked against tox.ini)
# `deepinfer conformance` runs cases of every module (one gloo world of 2 processes included); the pytest route
# proves the plugin loads and runs the suite, on a few cases
SUBSET = (
    "rms_norm or test_linear or round_trip or block_sizes or (paged_attention and ragged and gqa and bfloat16)"
    " or tokens_match_reference or (world1 and top2) or (world2 and top2) or (test_greedy_float32 and q_proj)"
    " or (prefix_cache and float32) or hc_pre"
)
SMOKE = "rms_norm or hc_pre"
COMMAND_TIMEOUT_S = 300
SCRIPTS = ("pip", "deepinfer", "pytest")  # console scripts the guide's commands call


@dataclass(frozen=True)
class Block:
    lang: str
    title: str | None
    text: str


def guide_blocks(text: str) -> list[Block]:
    """Fenced code blocks of the guide, in order: ```lang title="..."``` ... ```."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = re.match(r"^```(\w*)(.*)$", lines[i])
        if not opening:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        title = re.search(r'title="([^"]+)"', opening.group(2))
        blocks.append(Block(opening.group(1), title and title.group(1), "\n".join(lines[i + 1 : end]) + "\n"))
        i = end + 1
    return blocks


BLOCKS = guide_blocks(GUIDE.read_text())


def vendor_files() -> dict[str, str]:
    return {b.title: b.text for b in BLOCKS if b.title and b.lang != "console"}


def walked_commands() -> list[str]:
    return [
        line.removeprefix("$ ")
        for b in BLOCKS
        if b.lang == "console" and b.title != NOT_WALKED
        for line in b.text.splitlines()
        if line.startswith("$ ")
    ]


# ------------------------------------------------------------------------------ the vendor's environment


def _console_script(name: str) -> str:
    """`module:attr` of console script `name` in this environment, or fail saying what is missing."""
    found = importlib.metadata.entry_points(group="console_scripts", name=name)
    if not found:
        pytest.fail(
            f"no `{name}` console script is installed in this environment ({sys.executable}): the vendor walk runs "
            f"the guide's `{name}` commands; install it (pip, deepinfer and deepinfer[conformance]'s pytest)"
        )
    return next(iter(found)).value


def make_vendor_venv(path: Path) -> Path:
    """A venv at `path` that sees this environment's packages (a .pth runs site.addsitedir on them, so their
    own .pth files, editable installs included, work) and has pip/deepinfer/pytest scripts; its bin folder."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(path)
    bin_dir, python = path / "bin", path / "bin" / "python"  # POSIX, like the guide's console blocks
    own_site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    parents = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    lines = [f"import site; site.addsitedir({p!r})" for p in parents]
    (Path(own_site) / "zz_deepinfer_vendor_walk.pth").write_text("\n".join(lines) + "\n")
    for name in SCRIPTS:
        module, _, attr = _console_script(name).partition(":")
        script = bin_dir / name
        script.write_text(f"#!{python}\nimport sys\nfrom {module} import {attr.split('.')[0]}\nsys.exit({attr}())\n")
        script.chmod(0o755)
    return bin_dir


def run(command: str, cwd: Path, bin_dir: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("DEEPINFER_ACCELERATOR", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(
        PATH=os.pathsep.join([str(bin_dir), env.get("PATH", "")]),
        VIRTUAL_ENV=str(bin_dir.parent),
        PIP_NO_INDEX="1",  # offline: everything the vendor's package needs is installed already
        PIP_NO_BUILD_ISOLATION="0",  # (sic: pip reads "0" as "no isolation") build with this env's setuptools
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        OMP_NUM_THREADS="1",  # tiny models: see tests/conftest.py's run_cli
        MKL_NUM_THREADS="1",
    )
    return subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
    )


# ------------------------------------------------------------------------------ what each step must show


def _report_cases(repo: Path) -> dict[str, dict]:
    """The cases of the run's report.json (then removed: the next route writes its own), none failed,
    rms_norm (the op the guide ports) passed and the V4 cases skipped with the backend's reason."""
    path = repo / "report.json"
    assert path.exists(), "no report.json written"
    report = json.loads(path.read_text())
    path.unlink()
    assert report["backend"]["name"] == "myvendor", report["backend"]
    cases = {c["case"]: c for c in report["cases"]}
    bad = {name: c["reason"][:300] for name, c in cases.items() if c["status"] in ("failed", "error")}
    assert not bad, f"cases failed: {bad}"
    assert any(n.startswith("ops::test_rms_norm") and c["status"] == "passed" for n, c in cases.items())
    v4 = [c for n, c in cases.items() if n.startswith(("v4_ops::", "v4_attention::"))]
    assert v4 and all(c["status"] == "skipped" and "not ported to MyVendor yet" in c["reason"] for c in v4)
    return cases


def check_backends(result, repo):
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("myvendor")), None)
    assert line, f"myvendor is not listed:\n{result.stdout}"
    assert "deepinfer-myvendor 0.1.0" in line and " available " in line and "(mv)" in line, line


def check_select(result, repo):
    assert result.stdout.startswith("myvendor "), result.stdout


def check_tiny_v3(result, repo):
    assert (repo / "tiny-v3" / "config.json").exists() and (repo / "tiny-v3" / "model.safetensors").exists()


def check_generate(result, repo):
    if "--model" in result.args[-1]:
        assert "backend myvendor" in result.stderr and "8 tokens, finish reason length" in result.stderr
        assert len(result.stdout.split()) == 8, result.stdout  # token ids: the model has no tokenizer
    else:  # the V4 demo under auto: refused by myvendor, naming what it lacks, then run on cpu
        assert "myvendor cannot run DeepSeek-V4" in result.stderr and "not ported to MyVendor yet" in result.stderr
        assert "backend cpu" in result.stderr and "8 tokens" in result.stderr


def check_conformance(result, repo):
    cases = _report_cases(repo)
    for module in ("ops", "kv", "attention", "sampler", "dispatch", "end_to_end", "prefix_cache"):
        assert any(n.startswith(f"{module}::") and c["status"] == "passed" for n, c in cases.items()), (
            f"no {module} case passed: the hooks behind it are not exercised"
        )
    assert any("world2" in n and c["status"] == "passed" for n, c in cases.items()), (
        "no multi-process dispatch case ran: the guide's backend lists torch_distributed:gloo"
    )


def check_pytest_route(result, repo):
    _report_cases(repo)


def check_installed(result, repo):
    assert (repo / "deepinfer_myvendor.egg-info").is_dir() or "Successfully installed" in result.stdout


CHECKS = {  # command prefix -> what it must show; the guide must have a step for each
    "pip install -e": check_installed,
    "deepinfer backends": check_backends,
    "DEEPINFER_ACCELERATOR=myvendor deepinfer backends --select": check_select,
    "python -m deepinfer_conformance.tiny_v3": check_tiny_v3,
    "DEEPINFER_ACCELERATOR=myvendor deepinfer generate --model": check_generate,
    "deepinfer generate": check_generate,
    "deepinfer conformance": check_conformance,
    "pytest --deepinfer-backend=myvendor": check_pytest_route,
}


def adjusted(command: str) -> str:
    """The command as the walk runs it: the conformance routes on part of the suite."""
    if command.startswith("deepinfer conformance"):
        return f"{command} -k {shlex.quote(SUBSET)}"
    if command.startswith("pytest"):
        return f"{command} -k {shlex.quote(SMOKE)}"
    return command


def check_for(command: str):
    """The check of the longest prefix of CHECKS that `command` starts with, or None."""
    prefixes = [p for p in CHECKS if command.startswith(p)]
    return CHECKS[max(prefixes, key=len)] if prefixes else None


# ------------------------------------------------------------------------------ the walk


def test_the_guide_has_the_vendor_files_and_steps():
    files = vendor_files()
    assert {"pyproject.toml", "deepinfer_myvendor/__init__.py", "deepinfer_myvendor/plugin.py"} <= set(files)
    commands = walked_commands()
    for prefix in CHECKS:
        assert any(c.startswith(prefix) for c in commands), f"the guide has no step `{prefix} ...`"


def test_the_guide_works_as_written(tmp_path):
    if shutil.which("bash") is None:
        pytest.fail("the vendor walk runs the guide's console lines with bash, which is not on PATH")
    repo = tmp_path / "deepinfer-myvendor"
    for name, text in vendor_files().items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    bin_dir = make_vendor_venv(tmp_path / "venv")
    for command in walked_commands():
        result = run(adjusted(command), repo, bin_dir)
        assert result.returncode == 0, (
            f"the guide's step `{command}` exited with {result.returncode}:\n"
            f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n{result.stderr[-6000:]}"
        )
        check = check_for(command)
        if check is not None:
            try:
                check(result, repo)
            except AssertionError as err:
                raise AssertionError(
                    f"the guide's step `{command}` did not do what the guide says: {err}\n"
                    f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}"
                ) from None
    # what the guide says in prose: the V4 demo on this backend, named, is an error naming what it lacks
    refused = run("DEEPINFER_ACCELERATOR=myvendor deepinfer generate --prompt Hello --max-tokens 1", repo, bin_dir)
    assert refused.returncode != 0 and "myvendor cannot run DeepSeek-V4" in refused.stderr, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr, refused.stderr[-3000:]


def test_the_guides_python_is_python():
    import ast

    for block in BLOCKS:
        if block.lang == "python":
            ast.parse(block.text)  # also the snippets that are not files of the walk


def test_tox_installs_what_the_guide_says():
    """The tox route is not walked (it needs DeepInfer's repository, tox and the network): its two halves,
    the guide's command and tox.ini's conformance env, must name the same variable."""
    import configparser

    [command] = [b.text for b in BLOCKS if b.lang == "console" and b.title == NOT_WALKED]
    variable = re.search(r"(DEEPINFER_CONFORMANCE_\w+)=", command).group(1)
    assert "DEEPINFER_ACCELERATOR=myvendor" in command and "tox -e conformance" in command
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    assert f"{{env:{variable}:}}" in tox["testenv:conformance"]["commands_pre"]
    assert "{env:DEEPINFER_ACCELERATOR" in tox["testenv:conformance"]["commands"]


def test_the_guide_spells_the_dispatch_capability_as_the_suite_does():
    source = (ROOT / "conformance" / "deepinfer_conformance" / "cases" / "test_dispatch.py").read_text()
    gloo = re.search(r'^GLOO = "([^"]+)"', source, re.MULTILINE).group(1)
    text = GUIDE.read_text()
    assert (
        f'"{gloo}"' in text
        and f'communicators=("in_process", "{gloo}")' in vendor_files()["deepinfer_myvendor/plugin.py"]
    )
