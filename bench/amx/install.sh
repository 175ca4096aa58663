#!/usr/bin/env bash
# From the staged folders (bench/amx/stage.sh): unpack the carried CPython 3.11 into PYHOME, then
# join the parts, check every file against SHA256SUMS and install all wheels (no deps, no index)
# into SITE with that interpreter's own pip (the wheel ensurepip bundles). Progress goes to stderr;
# the last (only) stdout line is SITE. `install.sh --python-only` stops after the interpreter (it
# travels in .amxA) and prints PYHOME. Idempotent: finished steps are reused while the machine stays
# warm. PYHOME=${AMX_PYHOME:-$TMPDIR/amx-python}, SITE=${AMX_SITE:-$TMPDIR/amx-site}.
# The interpreter runs with: LD_LIBRARY_PATH=$PYHOME/lib:$PYHOME/lib/use (bench/amx/run.sh sets it).
set -euo pipefail
T="${TMPDIR:-/tmp}"
STAGE="${AMX_STAGE:-$T/amx-stage}"
PYHOME="${AMX_PYHOME:-$T/amx-python}"
SITE="${AMX_SITE:-$T/amx-site}"
[ -f "$STAGE/SHA256SUMS" ] || { echo "install: no $STAGE/SHA256SUMS: stage .amxA first" >&2; exit 1; }
cd "$STAGE"
export LD_LIBRARY_PATH="$PYHOME/lib:$PYHOME/lib/use${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONNOUSERSITE=1 PIP_CONFIG_FILE=/dev/null

# Does the machine have this shared library (by soname)?
have_lib() {
  ldconfig -p 2>/dev/null | awk '{print $1}' | grep -qxF "$1" && return 0
  for d in /lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu /lib64 /usr/lib64 /usr/lib /lib; do
    [ -e "$d/$1" ] && return 0
  done
  return 1
}

if [ ! -f "$PYHOME/.ready" ]; then
  tarball=$(grep -o 'cpython-[^ ]*\.tar\.gz' SHA256SUMS)
  [ -f "$tarball" ] || { echo "install: $tarball not staged: stage .amxA first" >&2; exit 1; }
  grep -F "  $tarball" SHA256SUMS | sha256sum -c --quiet - >&2 || { echo "install: $tarball checksum failed" >&2; exit 1; }
  rm -rf "$PYHOME"; mkdir -p "$PYHOME"
  tar -C "$PYHOME" -xzf "$tarball"
  mkdir -p "$PYHOME/lib/use"      # a carried library only where the machine lacks that soname
  for so in "$PYHOME"/lib/extra/*; do
    n=$(basename "$so")
    have_lib "$n" || { ln -s "../extra/$n" "$PYHOME/lib/use/$n"; echo "install: using the carried $n" >&2; }
  done
  echo "install: glibc $(ldd --version 2>&1 | head -1 | grep -o '[0-9.]*$') (the interpreter needs 2.35)" >&2
  "$PYHOME/bin/python3" -c 'import sys, ssl, ctypes, sqlite3, lzma, bz2, zlib, uuid, pyexpat, ctypes.util
print("install: python", sys.version.split()[0], "at", sys.prefix, "| libnuma:", ctypes.util.find_library("numa") or "absent", file=sys.stderr)' \
    || { echo "install: the carried interpreter does not run here (glibc older than 2.35?)" >&2; exit 1; }
  touch "$PYHOME/.ready"
fi
if [ "${1:-}" = --python-only ]; then echo "$PYHOME"; exit 0; fi

if [ ! -f "$SITE/.installed" ]; then
  missing=$(grep -v '^#' FILES.txt | while read -r dir size name; do   # every part and file here?
    [ "$(stat -c %s "$name" 2>/dev/null)" = "$size" ] || echo "$dir"; done | sort -u | xargs)
  [ -z "$missing" ] || { echo "install: still to carry: $missing (machine went back?)" >&2; exit 1; }
  joined=$(ls ./*.part?? 2>/dev/null | sed 's/\.part..$//' | sort -u | xargs)
  for w in $joined; do                            # parts sort aa, ab, ... in order
    [ -f "$w" ] || { cat "$w".part?? > "$w.tmp" && mv "$w.tmp" "$w"; }
  done
  if ! sha256sum -c --quiet SHA256SUMS >&2; then  # joined files + all other files
    rm -f $joined; echo "install: checksum failed (corrupt or stale file; staged again?)" >&2; exit 1
  fi
  rm -rf "$SITE"
  pip_whl=$(ls "$PYHOME"/lib/python3.*/ensurepip/_bundled/pip-*.whl)
  PIP_ROOT_USER_ACTION=ignore PYTHONPATH="$pip_whl" "$PYHOME/bin/python3" -m pip install -q --disable-pip-version-check --no-index \
    --no-deps --no-compile --target "$SITE" $(grep -o '[^ ]*\.whl$' SHA256SUMS) >&2
  touch "$SITE/.installed"
  echo "install: $(grep -c '\.whl$' SHA256SUMS) wheels installed into $SITE" >&2
fi
echo "$SITE"
