"""Pack files into the ignored folders one device call carries each (.gpuA/, .gpuB/, ... or .amxA/, ...).

    python3 bench/gpu/pack.py PREFIX LIMIT SCRIPT --first F... --rest F... --sums F...

The --first files in their order, then the --rest largest first, go first-fit into folders
.{PREFIX}A, .{PREFIX}B, ... of at most LIMIT bytes each. .{PREFIX}A also gets SHA256SUMS (of the
--sums files: whole files, a split one is checked once joined) and FILES.txt (folder, size and
name of every packed file: stage.sh reads it to say which folders are still to carry). Used by
bench/gpu/wheels.sh and bench/amx/wheels.sh (SCRIPT names the caller in FILES.txt).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import string


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("prefix")
    ap.add_argument("limit", type=int)
    ap.add_argument("script")
    ap.add_argument("--first", nargs="*", default=[])
    ap.add_argument("--rest", nargs="*", default=[])
    ap.add_argument("--sums", nargs="*", default=[])
    a = ap.parse_args()

    files = a.first + sorted(a.rest, key=lambda p: -os.path.getsize(p))
    used: dict[str, int] = {}  # letter -> bytes
    placed = []
    for f in files:
        size = os.path.getsize(f)
        letter = next(c for c in string.ascii_uppercase if used.setdefault(c, 0) + size <= a.limit)
        used[letter] += size
        folder = f".{a.prefix}{letter}"
        os.makedirs(folder, exist_ok=True)
        shutil.copy(f, folder + "/")
        placed.append((folder, size, os.path.basename(f)))
    head = f".{a.prefix}A"
    with open(f"{head}/SHA256SUMS", "w") as s:
        for f in a.sums:
            s.write(f"{sha256(f)}  {os.path.basename(f)}\n")
    with open(f"{head}/FILES.txt", "w") as m:
        m.write(f"# folder size name ({a.script})\n")
        for folder, size, name in placed:
            m.write(f"{folder} {size} {name}\n")
    for letter in sorted(c for c in used if used[c]):
        print(f".{a.prefix}{letter}: {used[letter] / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
