"""Where the images' inputs and caches live: the project's root and its ``.cache``.

Below every other module of ``images`` (tags, the CUDA lock, the build script all read these), so
that none of them imports another only for a path.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the project's root
CACHE = ROOT / ".cache"
WHEELHOUSE = CACHE / "wheelhouse"  # one folder per Python: cp311/, cp312/
