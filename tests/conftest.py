"""Shared fixtures: real installs of the test distributions in tests/distributions."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

collect_ignore = ["distributions"]

DISTRIBUTIONS = Path(__file__).parent / "distributions"


@pytest.fixture(scope="session")
def install_distributions(tmp_path_factory):
    """install_distributions("test_backends", ...) -> a directory where pip installed those
    distributions (entry points included), to put on sys.path / PYTHONPATH. Cached per combination."""
    cache: dict[tuple[str, ...], Path] = {}

    def install(*names: str) -> Path:
        key = tuple(sorted(names))
        if key not in cache:
            root = tmp_path_factory.mktemp("site-" + ("-".join(key) or "empty"))
            target = root / "site"
            target.mkdir()
            sources = []
            for name in key:  # build from a copy so the source tree stays clean
                sources.append(str(shutil.copytree(DISTRIBUTIONS / name, root / "src" / name)))
            if sources:
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "pip",
                        "install",
                        "--quiet",
                        "--no-deps",
                        "--no-build-isolation",
                        "--no-index",
                        "--target",
                        str(target),
                        *sources,
                    ],
                    check=True,
                    capture_output=True,
                    text=True,
                )
            cache[key] = target
        return cache[key]

    return install


@pytest.fixture
def run_cli():
    """run_cli(args, site=None, env={}) -> CompletedProcess of the installed `deepinfer` command."""

    def run(args: list[str], site: Path | None = None, env: dict[str, str] | None = None):
        full_env = {k: v for k, v in os.environ.items() if k != "DEEPINFER_ACCELERATOR"}
        if site is not None:
            full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), full_env.get("PYTHONPATH")]))
        full_env.update(env or {})
        exe = shutil.which("deepinfer", path=str(Path(sys.executable).parent))
        assert exe, "the deepinfer console script is not installed next to this Python"
        return subprocess.run([exe, *args], capture_output=True, text=True, env=full_env, timeout=120)

    return run
