#!/bin/sh
# Seed the pod's writable Triton cache with the cubins built into the image (Triton
# reads and writes one cache directory), then run diptych with the container's args.
set -eu
if [ -n "${DIPTYCH_TRITON_PREBUILT:-}" ] && [ -d "$DIPTYCH_TRITON_PREBUILT" ]; then
    mkdir -p "$TRITON_CACHE_DIR"
    cp -Rn "$DIPTYCH_TRITON_PREBUILT"/. "$TRITON_CACHE_DIR"/ 2>/dev/null || true
fi
exec diptych "$@"
