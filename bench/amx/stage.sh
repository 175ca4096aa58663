#!/usr/bin/env bash
# Copy the folder(s) carried by this device call (.amxA/, .amxB/, ...) into STAGE.
# A carried folder is gone at the next call; STAGE (under the temp dir) stays while the
# machine stays warm, so one call per folder, back to back, fills it. Same as bench/gpu/stage.sh.
# Usage: bash bench/amx/stage.sh [FOLDER...]   (default: every .amx*/ folder present)
# Calling it again with the same folder is harmless (same names, overwritten).
set -euo pipefail
cd "$(dirname "$0")/../.."                       # repository root
STAGE="${AMX_STAGE:-${TMPDIR:-/tmp}/amx-stage}"
mkdir -p "$STAGE"
[ $# -gt 0 ] || set -- .amx*/
for d in "$@"; do
  [ -d "$d" ] || { echo "stage: no folder $d (name it in the call's carry)" >&2; exit 1; }
  cp -f "$d"/* "$STAGE"/
  echo "stage: $(ls "$d" | wc -l) files from $d -> $STAGE"
done
# Once the manifest (carried in .amxA) is staged, say which folders are still missing.
if [ -f "$STAGE/FILES.txt" ]; then
  missing=$(grep -v '^#' "$STAGE/FILES.txt" | while read -r dir size name; do
    [ "$(stat -c %s "$STAGE/$name" 2>/dev/null)" = "$size" ] || echo "$dir"; done | sort -u | xargs)
  if [ -n "$missing" ]; then echo "stage: still to carry: $missing"; else echo "stage: all files staged"; fi
else
  echo "stage: manifest not staged yet (it travels in .amxA)"
fi
