#!/usr/bin/env bash
# Issue 24's many-core and GPU measurements, as one script for a lent machine with 16
# cores and one GPU and no network (its own python3 with NumPy, PyTorch, Pillow, psutil).
#
# What it needs beside the repository, in .devpack/ (made on a networked machine):
#   whl/  wheels the machine's image lacks (simplejpeg, google-crc32c, pypng), for its
#         Python (cp312);
#   ext/  headrace's two C extensions built for that Python (_hrio, _jpeg);
#   lib/  libjpeg.so.62 (libjpeg-turbo), which _jpeg links.
# Without ext/ it builds them there, and without a compiler headrace runs its pure-Python
# fallbacks (the log says which). Made here (x86-64, a Python 3.12 with its headers):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 -d .devpack/whl simplejpeg google-crc32c pypng
#   gcc -shared -fPIC -O3 -std=c11 -I$PY312_INCLUDE src/headrace/io/_ext/hrio.c \
#       -o .devpack/ext/_hrio.cpython-312-x86_64-linux-gnu.so   (and image/_ext/jpeg.c -ljpeg)
#   cp -L /lib/x86_64-linux-gnu/libjpeg.so.62 .devpack/lib/
# and kept out of git (.git/info/exclude: /.devpack/).
#
#     OUT=/tmp/out bash benchmarks/device.sh
#
# QUICK=1 runs every step small (a smoke test of the script on any machine; with
# DEVICE=cpu the host-to-GPU step runs its CPU backend).
#
# Every benchmark runs under its own time limit, most important first, so one that
# fails or overruns leaves the others' results; the results pages of the run go to
# $OUT/device-results.tgz and the whole log to $OUT/device.log.
set -u
OUT=${OUT:-/tmp/headrace-device}
mkdir -p "$OUT"
exec > >(tee "$OUT/device.log") 2>&1
cd "$(dirname "$0")/.."
PY=${PY:-python3}
PACK=.devpack
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=3
touch "$OUT/.start"

echo "== machine"
date -u; nproc; free -g | head -2; nvidia-smi -L 2>&1 | head -2
$PY -c 'import sys, numpy, torch; print(sys.version.split()[0], "numpy", numpy.__version__, "torch", torch.__version__, "cuda", torch.cuda.is_available())'

echo "== packages"
if [ -d $PACK/whl ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site $PACK/whl/*.whl && export PYTHONPATH=/tmp/site
fi
export LD_LIBRARY_PATH=$PWD/$PACK/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
cp $PACK/ext/_hrio.*.so src/headrace/io/ 2>/dev/null
cp $PACK/ext/_jpeg.*.so src/headrace/image/ 2>/dev/null
native='import headrace.io._hrio, headrace.image._jpeg'
if ! PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} $PY -c "$native"; then
    echo "carried extensions do not load; building them here"
    $PY setup.py build_ext --inplace -q 2>&1 | tail -5
fi
PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} $PY -c "$native" && echo "C extensions: loaded" \
    || echo "C extensions: NOT loaded (pure-Python fallbacks: the numbers below are slower)"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}

step() {  # step SECONDS NAME COMMAND...
    local limit=$1 name=$2
    shift 2
    echo "== $name (limit ${limit}s) $(date -u +%T)"
    local started=$SECONDS
    timeout --kill-after=10 "$limit" "$@"
    echo "== $name: exit $? after $((SECONDS - started)) s"
    # the results so far, so that a run cut short still returns them
    find benchmarks/results -newer "$OUT/.start" -type f | tar czf "$OUT/device-results.tgz" -T -
}

Q=${QUICK:+--quick}
if [ -n "${QUICK:-}" ]; then IMAGES="--images 300 --seconds 1 --scaling 1,2"
else IMAGES="--images 500 --seconds 5 --scaling 1,4,16"; fi
STEPS=${STEPS:-host-to-gpu workers images overhead}
want() { [[ " $STEPS " == *" $1 "* ]]; }
# host -> GPU: GB/s of shuffled 224x224x3 uint8 batches reaching the device (~75 s)
want host-to-gpu && step 150 host-to-gpu $PY benchmarks/bench_host_to_gpu.py \
    --device "${DEVICE:-cuda}" $Q
# a 1 ms pure-Python map: 1 thread vs N worker processes vs DataLoader(N workers) (~15 s)
for n in ${WORKERS:-16}; do
    want workers && step 60 "workers $n" $PY benchmarks/bench_workers.py --only python_map \
        --workers "$n" --out "workers-device-$n" $Q
done
# the image pipelines on 1..16 processes and threads, each timed for 5 s (~2 min)
want images && step 170 images $PY benchmarks/bench_images.py $IMAGES ${IMAGE_ARGS:-} \
    --no-peak --out images-scaling-device
# per-batch overhead against plain NumPy loops (the whole page: OVERHEAD_ARGS='')
want overhead && step 120 overhead $PY benchmarks/bench_overhead.py \
    ${OVERHEAD_ARGS---only batch(1024) --passes 3} --out overhead-device $Q

echo "== done $(date -u +%T): $(tar tzf "$OUT/device-results.tgz" | tr '\n' ' ')"
