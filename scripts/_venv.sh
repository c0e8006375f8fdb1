# Sourced by the other scripts: create .venv (once) and install headrace with every extra
# its tests and benchmarks need. Idempotent: a second run only checks what is there.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HEADRACE_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
EXTRAS="${HEADRACE_EXTRAS:-dev,tf,torch,arrow,postgres,keras,jax,orbax,ray,bench,snappy,image,docs,s3}"
# One stamp per set of extras: the demo's lighter install must not stop the test
# script from adding TensorFlow to the same venv later.
STAMP="$VENV/.headrace-installed-${EXTRAS//,/-}"
# headrace.image's C extension links the system's libjpeg-turbo: without its headers the
# build skips it (headrace then decodes whole images through simplejpeg)
if [ ! -f /usr/include/jpeglib.h ] && command -v apt-get >/dev/null; then
    SUDO=""; if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libjpeg-dev >/dev/null
    rm -f "$STAMP"
fi
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ] || [ "$ROOT/setup.py" -nt "$STAMP" ] \
        || [ "$ROOT/src/headrace/io/_ext/hrio.c" -nt "$STAMP" ] \
        || [ "$ROOT/src/headrace/image/_ext/jpeg.c" -nt "$STAMP" ]; then
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    if [[ ",$EXTRAS," == *",torch,"* ]] && ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
        # torch's CPU build first (the [torch] extra takes any build, and PyPI's default
        # pulls gigabytes of CUDA): only PyTorch's CPU index is searched (and find-links
        # given in the environment: a machine's offline wheels), so CUDA builds that
        # pip.conf's indexes hold are never candidates. Its dependencies come with the
        # install below, from the usual indexes.
        PIP_CONFIG_FILE=/dev/null "$VENV/bin/python" -m pip install --quiet --no-deps \
            --retries 1 --timeout 15 --only-binary :all: torch \
            --index-url "${HEADRACE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
    fi
    "$VENV/bin/python" -m pip install --quiet -e "$ROOT[$EXTRAS]"
    touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
