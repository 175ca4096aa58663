#!/usr/bin/env bash
# Join the vllm wheel parts, check every wheel against SHA256SUMS, install all wheels
# (no deps, no index) into SITE under the temp dir. Progress goes to stderr; the last
# (only) stdout line is SITE, so:  SITE=$(bash bench/gpu/install.sh) && export PYTHONPATH=$SITE:$PWD
# Idempotent: a finished install (SITE/.installed) is reused while the machine stays warm.
set -euo pipefail
T="${TMPDIR:-/tmp}"
STAGE="${GPU_STAGE:-$T/gpu-stage}"
SITE="${GPU_SITE:-$T/gpu-site}"
if [ ! -f "$SITE/.installed" ]; then
  [ -f "$STAGE/SHA256SUMS" ] || { echo "install: no $STAGE/SHA256SUMS: stage .gpuA first" >&2; exit 1; }
  cd "$STAGE"
  missing=$(grep -v '^#' FILES.txt | while read -r dir size name; do   # every part and wheel here?
    [ "$(stat -c %s "$name" 2>/dev/null)" = "$size" ] || echo "$dir"; done | sort -u | xargs)
  [ -z "$missing" ] || { echo "install: still to carry: $missing (machine went back?)" >&2; exit 1; }
  W=$(grep -o 'vllm-[^ ]*\.whl' SHA256SUMS)
  [ -f "$W" ] || cat "$W".part* > "$W"            # parts sort aa, ab, ... in order
  if ! sha256sum -c --quiet SHA256SUMS >&2; then   # joined vllm wheel + all other wheels
    rm -f "$W"; echo "install: checksum failed (corrupt or stale file; staged again?)" >&2; exit 1
  fi
  rm -rf "$SITE"
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$STAGE"/*.whl >&2
  touch "$SITE/.installed"
  echo "install: $(ls "$STAGE"/*.whl | wc -l) wheels installed into $SITE" >&2
fi
echo "$SITE"
