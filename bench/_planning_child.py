"""One process of ``bench.planning_commits``: plans the dataset PASSES times with each tokenizer.

    python -P bench/_planning_child.py DATA TOKENIZERS_DIR WORKERS

Imports nothing of ``bench`` (the tree on PYTHONPATH provides ``datagen``, whichever commit it is);
prints one JSON line per plan.
"""

from __future__ import annotations

import hashlib
import json
import resource
import sys
import time
from pathlib import Path

PASSES = 3  # plans per tokenizer in one process
TOKENIZERS = ("slow", "fast")


def _cpu() -> float:
    """CPU seconds of this process and of its finished child processes (the planning workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def main(data: str, tokenizers: str, workers: int) -> None:
    import datagen
    from datagen.data import planning
    from transformers import AutoTokenizer

    toks = {"slow": AutoTokenizer.from_pretrained(Path(tokenizers) / "kimi-slow", trust_remote_code=True),
            "fast": AutoTokenizer.from_pretrained(Path(tokenizers) / "kimi-fast")}
    hashes_at, in_plan = planning._hashes, []

    def timed_hashes(tokenizer):  # the tokenizer's fingerprint: once per plan, whatever the rows
        t = time.thread_time()
        try:
            return hashes_at(tokenizer)
        finally:
            in_plan.append(time.thread_time() - t)

    planning._hashes = timed_hashes
    for name in TOKENIZERS * PASSES:
        tok = toks[name]
        in_plan.clear()
        c = _cpu()
        out = planning.prepare_dataset(data, load_tokenizer=lambda tok=tok: tok, workers=workers,
                                       vocab_size=163840, max_seq_len=8192)
        cpu_s = _cpu() - c
        digest = hashlib.sha256()
        for r in sorted(out.samples):
            s = out.samples[r]
            digest.update(r.to_bytes(8, "little") + s.input_ids.tobytes() + s.loss_mask.tobytes())
        print(json.dumps({"datagen": datagen.__file__, "tokenizer": name, "cpu_s": cpu_s,
                          "fingerprint_cpu_s": sum(in_plan), "samples": digest.hexdigest(),
                          "tokens": sum(len(s.input_ids) for s in out.samples.values())}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
