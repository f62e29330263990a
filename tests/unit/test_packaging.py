"""The wheel ``pip install`` builds holds every module of the package (a subpackage left out of
``setup.py`` once broke every install but the editable one: ``No module named 'ringcore.plans'``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# where each installed package's files come from in the repository
SOURCES = {
    "ringcore": "ringcore",
    "ringcore/torch": "bindings/torch",
    "ringcore/jax": "bindings/jax",
    "ringcore/ray": "bindings/ray",
    "ringcore/bench": "bench",
}


def expected_files() -> set[str]:
    """Every ``.py`` (and the CUDA source, the type marker) of the repository's packages, as the wheel names them."""
    names = {"ringcore/py.typed", "ringcore/kernels/cuda/reduce.cu"}
    for installed, source in SOURCES.items():
        base = ROOT / source
        pattern = "**/*.py" if installed == "ringcore" else "*.py"
        names |= {f"{installed}/{path.relative_to(base).as_posix()}" for path in base.glob(pattern)}
    names |= {f"ringcore/bench/peers/{path.name}" for path in (ROOT / "bench/peers").glob("*.py")}
    return names


@pytest.mark.timeout(300)
def test_the_wheel_holds_every_module(tmp_path: Path) -> None:
    if shutil.which("git") is None:
        pytest.skip("git is needed to copy the tracked tree")
    tree = tmp_path / "tree"
    tracked = (
        subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, tracked):  # a copy of the tracked files: the build leaves nothing behind
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / name).is_file():
            shutil.copy2(ROOT / name, tree / name)
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            ".",
        ],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("ringcore-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(expected_files() - names)
    assert not missing, f"setup.py leaves these out of the wheel: {missing}"
