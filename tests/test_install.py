"""The set-up scripts respect the user's torch (scripts/pip.sh, docs/installation.md).

Each case is a throwaway virtual environment without pip or site packages, holding a
stand-in ``torch`` package that only has a ``__version__``: the scripts' decision reads
the version by importing torch, so the stand-in is what they see, and nothing is ever
installed (``quiet_pip`` is replaced by a function that prints what it was asked).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.quick  # bare venvs, no torch import: seconds


def _venv(folder: Path, torch_version: str | None) -> Path:
    """A bare venv (no pip), with a stand-in torch of ``torch_version`` if given."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    if torch_version is not None:
        purelib = subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True).stdout.strip()
        (Path(purelib) / "torch").mkdir(parents=True)
        (Path(purelib) / "torch" / "__init__.py").write_text(
            f"__version__ = {torch_version!r}\n")
    return folder / "bin"


def _setup(bin_dir: Path, shell: str, gpu: bool = False) -> subprocess.CompletedProcess:
    """Run ``shell`` after sourcing scripts/pip.sh, with pip replaced by a recorder and
    only the venv's python and, with ``gpu``, a stand-in ``nvidia-smi`` on PATH (the
    scripts need no other program), so the host's own driver tools never decide."""
    tools = bin_dir.parent / "tools"
    tools.mkdir(exist_ok=True)
    if gpu:
        (tools / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA stand-in'\n")
        (tools / "nvidia-smi").chmod(0o755)
    script = ("set -euo pipefail; source scripts/pip.sh; "
              "quiet_pip() { echo \"pip install $*\"; }; " + shell)
    env = {"PATH": f"{bin_dir}:{tools}", "HOME": str(bin_dir.parent)}
    return subprocess.run([shutil.which("bash"), "-c", script], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("version", ["2.11.0", "2.12.1+cu128", "2.13.0+cpu"])
def test_a_supported_torch_is_kept(tmp_path, version):
    bin_dir = _venv(tmp_path / "venv", version)
    assert _setup(bin_dir, "torch_decision").stdout.strip() == f"keep {version}"
    done = _setup(bin_dir, "ensure_torch")
    assert done.returncode == 0, done.stderr
    assert f"keeping the installed torch {version}" in done.stdout
    assert "pip install" not in done.stdout  # nothing replaces it


@pytest.mark.parametrize("version", ["2.10.2", "2.14.0", "2.14.0.dev20260101"])
def test_an_unsupported_torch_stops_the_setup_unchanged(tmp_path, version):
    bin_dir = _venv(tmp_path / "venv", version)
    assert _setup(bin_dir, "torch_decision").stdout.strip() == f"unsupported {version}"
    done = _setup(bin_dir, "ensure_torch")
    assert done.returncode != 0
    assert f"torch {version} is installed, but simplefsdp supports 2.11 <= torch < 2.14" \
        in done.stderr
    assert "pip install" not in done.stdout


def test_torch_is_installed_only_where_missing(tmp_path):
    bin_dir = _venv(tmp_path / "venv", None)
    assert _setup(bin_dir, "torch_decision").stdout.strip() == "install"
    done = _setup(bin_dir, "ensure_torch")  # no nvidia-smi on this PATH: the CPU wheel
    assert done.returncode == 0, done.stderr
    assert "no torch installed: installing torch==2.13.0" in done.stdout
    assert re.search(r"^pip install torch==2\.13\.0 --extra-index-url "
                     r"https://download\.pytorch\.org/whl/cpu$", done.stdout, re.M), done.stdout
    gpu = _setup(bin_dir, "ensure_torch", gpu=True)  # a driver: PyPI's CUDA build
    assert gpu.returncode == 0, gpu.stderr
    assert re.search(r"^pip install torch==2\.13\.0$", gpu.stdout, re.M), gpu.stdout


def test_the_scripts_use_the_policy_and_pyproject_agrees():
    for script in ("train.sh", "test.sh"):
        text = (ROOT / "scripts" / script).read_text()
        assert "ensure_torch" in text and 'quiet_pip "torch' not in text, script
    pyproject = (ROOT / "pyproject.toml").read_text()
    pip_sh = (ROOT / "scripts" / "pip.sh").read_text()
    low = re.search(r'TORCH_MIN="([\d.]+)"', pip_sh).group(1)
    high = re.search(r'TORCH_BELOW="([\d.]+)"', pip_sh).group(1)
    assert f'"torch>={low},<{high}"' in pyproject  # one range, said in both places


@pytest.mark.skipif(not (ROOT / "pyproject.toml").exists(), reason="needs the checkout")
def test_pip_install_hf_resolves_against_the_tested_versions(tmp_path):
    """``pip install -e ".[hf]"`` (docs/installation.md) with this environment's packages
    (the versions CI tests: torch 2.13, transformers 5): pip's resolver, offline and in
    dry-run, must find every bound of pyproject.toml satisfied, installing nothing but
    the package itself. A bound that excludes a tested version fails here."""
    import json

    report = tmp_path / "report.json"
    env = dict(os.environ, PIP_ROOT_USER_ACTION="ignore", PIP_FIND_LINKS="",
               PIP_EXTRA_INDEX_URL="", PIP_CONSTRAINT="")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index",
         "--no-build-isolation", "--quiet", "--report", str(report), "-e", ".[hf,train,dev]"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    planned = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert planned == ["simplefsdp"], planned
    assert 'pip install -e ".[hf]"' in (ROOT / "docs" / "installation.md").read_text()
