#!/usr/bin/env bash
# Copy the folder(s) carried by this device call (.gpuA/, .gpuB/, ...) into STAGE.
# PACK names the family of folders: gpu (default: vLLM for the GPU) or amx (the CPU engine,
# bench/amx/stage.sh); STAGE is ${PACK^^}_STAGE if set, else the temp dir's $PACK-stage.
# A carried folder is gone at the next call; STAGE (under the temp dir) stays while the
# machine stays warm, so one call per folder, back to back, fills it.
# Usage: bash bench/gpu/stage.sh [FOLDER...]   (default: every .$PACK*/ folder present)
# Calling it again with the same folder is harmless (same names, overwritten).
set -euo pipefail
cd "$(dirname "$0")/../.."                       # repository root
PACK="${PACK:-gpu}"
stage_var="${PACK^^}_STAGE"
STAGE="${!stage_var:-${TMPDIR:-/tmp}/$PACK-stage}"
mkdir -p "$STAGE"
[ $# -gt 0 ] || set -- ".$PACK"*/
for d in "$@"; do
  [ -d "$d" ] || { echo "stage: no folder $d (name it in the call's carry)" >&2; exit 1; }
  cp -f "$d"/* "$STAGE"/
  echo "stage: $(ls "$d" | wc -l) files from $d -> $STAGE"
done
# Once the manifest (carried in .${PACK}A) is staged, say which folders are still missing.
if [ -f "$STAGE/FILES.txt" ]; then
  missing=$(grep -v '^#' "$STAGE/FILES.txt" | while read -r dir size name; do
    [ "$(stat -c %s "$STAGE/$name" 2>/dev/null)" = "$size" ] || echo "$dir"; done | sort -u | xargs)
  if [ -n "$missing" ]; then echo "stage: still to carry: $missing"; else echo "stage: all files staged"; fi
else
  echo "stage: manifest not staged yet (it travels in .${PACK}A)"
fi
