#!/usr/bin/env bash
# Build headrace's wheel (with its C extensions where a compiler is there) into DIR
# (default dist/): `bash scripts/wheel.sh [DIR]`. No dependencies are built or fetched;
# the build uses the running environment's setuptools when it has a recent enough one
# (offline), else pip's isolated build environment.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
OUT="${1:-$ROOT/dist}"
ISOLATION=()
if "$PY" -c 'import setuptools, sys, wheel; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' 2>/dev/null; then
    ISOLATION=(--no-build-isolation)
fi
# setuptools builds in the tree (build/): a module deleted since the last build would
# still be in build/lib and so in the wheel; compiled objects (build/temp*) are kept
rm -rf "$ROOT"/build/lib*
"$PY" -m pip wheel "$ROOT" --no-deps "${ISOLATION[@]}" --quiet -w "$OUT"
ls "$OUT"/headrace-*.whl
