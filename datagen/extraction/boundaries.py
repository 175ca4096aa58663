"""Where a plan cuts its rows into shards, and the shard group the engine streams them in.

Every row's token count is known at plan time, so the boundaries are fixed then, rows whole:

* by bytes (the default): a shard takes rows until its states reach half the target; from there it
  closes after row i when a hash of row i's identity (``PreparedDataset.line_hashes[i]``) falls under
  ``bytes_i / (target / 2)``, i.e. at a rate of one cut per target/2 bytes of states, so a shard holds
  about the target on average; before a row would take it past twice the target it closes anyway. A cut
  depends on the row's content and the bytes since the last cut, not on the row's position: an edited
  row whose token count changes moves the cuts of its shard, and the next cut that lands on a row where
  the old plan cut too puts every later boundary back where it was (usually the next shard or the one
  after). Appended rows move only the last shard's end.
* by rows (a spec's ``samples_per_shard`` S): rows [k*S, (k+1)*S) form shard k, as before.

A plan's boundaries are the tuple ``(b_0 = 0, b_1, ..., b_n = rows)``: shard k holds rows [b_k, b_k+1).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence


CUT_DOMAIN = b"datagen-shard-cut-1:"  # the hash a cut compares is the row's identity under this prefix
STEPS_PER_GROUP = 64  # a resolved shard group holds this many engine steps of tokens at least
MAX_SHARD_GROUP = 4096  # EngineSettings.shard_group's bound


def _cut_draw(identity: bytes) -> int:
    """A uniform 64-bit number from a row's identity (the same row draws the same number)."""
    return int.from_bytes(hashlib.sha256(CUT_DOMAIN + identity).digest()[:8], "little")


def byte_boundaries(tokens: Sequence[int], identities: Sequence[bytes], *, bytes_per_token: int,
                    target: int) -> tuple[int, ...]:
    """The content-defined boundaries of rows whose states weigh ``tokens[i] * bytes_per_token``.

    Args:
        tokens: tokens stored of each row (0 for a skipped row).
        identities: each row's identity (``PreparedDataset.line_hashes``), as many as ``tokens``.
        bytes_per_token: bytes of states per token (``datagen.data.contract.state_bytes``).
        target: the spec's shard bytes.

    Returns:
        ``(0, b_1, ..., len(tokens))``: shard k holds rows [b_k, b_k+1), each at least one row.
    """
    if len(tokens) != len(identities):
        raise ValueError(f"{len(tokens)} token counts for {len(identities)} row identities")
    half = max(target // 2, 1)
    cuts = [0]
    held = 0  # bytes of states in the shard being filled
    for i, n in enumerate(tokens):
        b = n * bytes_per_token
        if held and held + b > 2 * target:  # never past twice the target (unless one row is)
            cuts.append(i)
            held = 0
        held += b
        # P(cut) = b / half: the draw in [0, 2^64) under b * 2^64 / half, in integers
        if held >= half and _cut_draw(identities[i]) * half < b << 64:
            cuts.append(i + 1)
            held = 0
    if cuts[-1] != len(tokens):
        cuts.append(len(tokens))
    return tuple(cuts)


def row_boundaries(rows: int, per_shard: int) -> tuple[int, ...]:
    """Rows [k*S, (k+1)*S) for shard k (the last one shorter)."""
    return (*range(0, rows, per_shard), rows)


def byte_shard_group(target: int, *, bytes_per_token: int, step_tokens: int) -> int:
    """The fewest shards of ``target`` bytes whose tokens fill ``STEPS_PER_GROUP`` engine steps of
    ``step_tokens``: the engine drains once a group (its last steps run part full), so a group of
    64 steps loses about one step in 64; a resume recomputes a whole group, a few seconds of GPU.
    Of the target, not of the plan's shards: the fingerprint (which records it) must not depend on
    the dataset's rows, or an edited row would change every shard's key."""
    shard_tokens = max(target // bytes_per_token, 1)
    return min(MAX_SHARD_GROUP, max(1, math.ceil(STEPS_PER_GROUP * step_tokens / shard_tokens)))
