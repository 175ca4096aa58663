"""Extraction at the storage limit: one command, one table (bench/gpu/README.md stages vLLM first).

    python3 bench/gpu/storage.py --out $OUT                # on the GPU machine: the random 8B Llama
    python3 bench/gpu/storage.py --out $OUT --shape kimi   # Kimi-K2.5's width (hidden 7168, INT4 experts)
    python3 bench/gpu/storage.py --out /tmp/s --smoke      # any machine: tiny model, CPU engine

Side by side, on the same rows (random token ids, fixed length) and layers, each engine started
once in a process of its own and timed over several passes (median):

  plain            plain vLLM prefill (no capture), all rows in one generate: the engine's speed
  datagen          the project's extraction (VllmEngine: capture, worker-side shard writer, atomic
                   fsync'd shards), storage bf16; per shard (shard_group 1, a drain after every
                   shard) and streamed (shard_group = all shards of a pass, or --group)
  datagen fp8      the same with --storage-dtype fp8_e4m3 (half the bytes), streamed
  connector        vLLM's own extract_hidden_states + ExampleHiddenStatesConnector (one
                   safetensors file per request), timed until every file is written (into the
                   page cache: the connector does not fsync), and again until os.sync() returns
  transformers     the reference engine (`--engine hf`: transformers, one row at a time, shards)
  compiled         plain, datagen and datagen fp8 again without enforce_eager (torch.compile +
                   CUDA graphs, the production default)
  tp2              plain and datagen at tensor parallel 2, when two GPUs are visible
  disk             `dd oflag=direct` and the shard writer's own direct write (sha256 on the way);
                   the shard writer alone (write_shard of a real job: pack, statistics, sha256,
                   write, fsync) with 1, 2, 4 and 8 writers in parallel, onto the disk and into
                   RAM (/dev/shm)

Shapes (--shape): ``8b``, the random 8B Llama (hidden 4096, 4 of 32 layers captured, 32,773 bytes
per token), built on the GPU with transformers when --model does not exist; ``kimi``, the tiny
Kimi-K2.5 generator at its real width (hidden 7168, 64 heads, MLA, INT4 group-32 routed experts,
8 layers, 16 experts; layers [2, 4, 5, 7] captured: 57,348 bytes per token), built on the GPU.
Stages run in priority order within --budget seconds; a stage that would not fit is reported as
skipped, one that fails as failed (its error in the JSON), and the rest still run. The table
(table.md), the records (storage.json) and a plot (storage.png) go to --out; with --profile also
profile.md (each datagen pass: steps, GPU time of the forward and of the capture, GPU idle time,
gaps between steps, the driver's calls). One table over several device calls (each at most 10
minutes): the same --work with --merge and --only (the stage labels) on the warm machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

LAYERS_8B = (2, 16, 29, 32)
LAYERS_KIMI = (2, 4, 5, 7)  # of 8; the connector cannot take id N (the final norm's input), so 7 for both
KIMI_VOCAB = 163840
ROW_LEN = 1024
ENGINE = dict(max_num_batched_tokens=16384, max_num_seqs=256)


# --- helpers shared by the stages ---------------------------------------------------------------

def _rows(n: int, length: int, vocab: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab - 10, size=length).astype("int32") for _ in range(n)]


def _write_rows(path: Path, rows) -> None:
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps({"input_ids": r.tolist()}) + "\n")


def _cfg(args) -> dict:
    return json.loads(Path(args.work, "config.json").read_text())


def _plan(cfg: dict, out: Path, storage: str = "bfloat16", group: int = 1, tp: int = 1):
    from datagen.data.spec import parse_spec
    from datagen.extraction.plan import plan

    return plan(parse_spec({"model": cfg["model"], "dataset": cfg["data"], "out": str(out),
                            "layer_ids": cfg["layers"], "max_seq_len": cfg["row_len"] + 8,
                            "samples_per_shard": cfg["per_shard"],
                            "engine": {"dtype": "bfloat16", "storage_dtype": storage, "tensor_parallel_size": tp,
                                       "shard_group": group, **ENGINE}}))


# --- stages (each runs in a process of its own: `storage.py stage NAME`) --------------------------

def stage_model(args) -> dict:
    cfg = _cfg(args)
    if Path(cfg["model"], "config.json").exists():
        return {"built": False}
    if args.smoke:
        from datagen.models.tiny import TinyArch, make_model

        make_model(cfg["model"], arch=TinyArch.LLAMA, num_layers=6, with_tokenizer=False)
        return {"built": True}
    if cfg.get("shape") == "kimi":
        from datagen.models.kimi_config import kimi_width
        from datagen.models.tiny_kimi import make_tiny_kimi

        t0 = time.time()
        make_tiny_kimi(cfg["model"], quantization="int4", num_layers=8, n_routed_experts=16, num_experts_per_tok=8,
                       write_twin=False, device="cuda", **kimi_width())
        return {"built": True, "seconds": time.time() - t0}
    from bench.gpu.run import make_model as make_8b

    t0 = time.time()
    make_8b(argparse.Namespace(dir=cfg["model"]))
    return {"built": True, "seconds": time.time() - t0}


def stage_disk(args) -> dict:
    """The volume's direct-write speed: dd, then the shard writer's own write (hash + O_DIRECT)."""
    from datagen.data.shards.writer import _Buffer, write_image

    cfg = _cfg(args)
    work = Path(cfg["out_dir"])
    work.mkdir(parents=True, exist_ok=True)
    mb = 16 if args.smoke else 4096
    dd_line = dd_direct(work, mb)["dd"]
    size = (16 if args.smoke else 1024) << 20
    buf = _Buffer.get(size)
    buf[:size] = os.urandom(1 << 20) * (size >> 20)
    rates = []
    for i in range(4):
        t0 = time.time()
        _, direct = write_image(work / f"w{i}", buf, size)
        rates.append(size / (time.time() - t0))
    for i in range(4):
        (work / f"w{i}").unlink()
    t0 = time.time()
    import hashlib

    hashlib.sha256(memoryview(buf)[:size]).hexdigest()
    sha = size / (time.time() - t0)
    writers = {"disk": _writers(work / "writers", cfg, args), "ram": _writers(Path("/dev/shm") / "dg-writers", cfg, args)}
    return {"dd": dd_line, "dd_bytes_per_s": _dd_rate(dd_line), "writer_bytes_per_s": statistics.median(rates),
            "writer_direct": direct, "sha256_bytes_per_s": sha, "writers": writers}


def _writers(root: Path, cfg: dict, args) -> dict:
    """The shard writer alone: N threads each writing real shards (write_shard: pack into the file
    image, statistics from the given per-token sums, sha256 alongside the write, fsync, rename) of
    the pass's shape, states from host memory as the capture hands them over."""
    import threading

    import numpy as np
    import torch

    from datagen.data.shards.format import ShardJob
    from datagen.data.shards.kernels import token_stats
    from datagen.data.shards.writer import write_shard

    L, H = len(cfg["layers"]), cfg.get("hidden", 4096)
    rows, n = cfg["per_shard"], cfg["row_len"]
    if args.smoke:
        H = 64
    states = torch.randn(rows * n, L, H).to(torch.bfloat16)
    stats = token_stats(states)
    ids = np.arange(n, dtype=np.int32)
    shards = 4 if args.smoke else 16
    out = {}
    for w in (1, 2, 4, 8):
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
        jobs = [ShardJob(index=k, path=str(root / f"shard-{k:06d}.safetensors"), first_row=k * rows, rows=rows,
                         sample_rows=tuple(range(k * rows, (k + 1) * rows)), input_ids=(ids,) * rows,
                         loss_masks=(np.ones(n, dtype=np.uint8),) * rows, layer_ids=tuple(cfg["layers"]),
                         dtype="bfloat16", hidden_size=H, shard_key=f"k{k}") for k in range(shards)]
        todo = list(jobs)
        lock = threading.Lock()
        written = [0]

        def loop() -> None:
            while True:
                with lock:
                    if not todo:
                        return
                    job = todo.pop()
                rec = write_shard(job, [states[i * n:(i + 1) * n] for i in range(rows)],
                                  [stats[i * n:(i + 1) * n] for i in range(rows)])
                with lock:
                    written[0] += rec.bytes

        t0 = time.time()
        threads = [threading.Thread(target=loop) for _ in range(w)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out[str(w)] = written[0] / (time.time() - t0)
    shutil.rmtree(root, ignore_errors=True)
    return out


def dd_direct(work: Path, mb: int) -> dict:
    """``dd oflag=direct`` of ``mb`` MB into ``work``: its last line and the rate it names."""
    target = work / "ddtest"
    proc = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={max(1, mb // 16)}", "oflag=direct"],
                          capture_output=True, text=True)
    target.unlink(missing_ok=True)
    line = (proc.stderr.strip().splitlines() or ["?"])[-1]
    return {"dd": line, "dd_bytes_per_s": _dd_rate(line)}


def _dd_rate(line: str) -> float | None:
    # "... bytes (...) copied, 3.1 s, 1.4 GB/s"
    try:
        n, unit = line.rsplit(",", 1)[1].split()
        return float(n) * {"kB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12}[unit]
    except (ValueError, KeyError, IndexError):
        return None


def stage_plain(args) -> dict:
    from vllm.inputs import TokensPrompt

    from bench.gpu.timing import plain_prefill
    from datagen.engines.vllm_engine import VllmEngine

    cfg = _cfg(args)
    p = _plan(cfg, Path(cfg["out_dir"]) / "plain", tp=args.tp)
    eng = VllmEngine(p.info, layer_ids=p.layer_ids, dtype="bfloat16", storage_dtype="bfloat16",
                     max_seq_len=p.spec.max_seq_len, tensor_parallel_size=args.tp, **ENGINE)
    rows = _rows(cfg["rows"], cfg["row_len"], cfg["vocab"])
    prompts = [TokensPrompt(prompt_token_ids=r.tolist()) for r in rows]
    rates, start = plain_prefill(eng, prompts, tokens=cfg["rows"] * cfg["row_len"], repeats=cfg["passes"],
                                 warmup=cfg["per_shard"], until="synced")
    return {"tokens_per_s": rates, "engine_start_s": start}


def stage_datagen(args) -> dict:
    """The real engine over fresh output directories; per-shard and streamed passes alternate."""
    from datagen.engines.vllm_engine import VllmEngine
    from datagen.extraction.output import claim_output
    from datagen.extraction.manifest import write_manifest
    from datagen.extraction.run import build_job, extract_shards

    cfg = _cfg(args)
    root = Path(cfg["out_dir"])
    storage = args.storage
    os.environ.setdefault("DATAGEN_GPU_STEP_TIMES", "1")  # the worker's trace times each step on the GPU too
    p0 = _plan(cfg, root / "warm", storage, tp=args.tp)
    t0 = time.time()
    eng = VllmEngine(p0.info, layer_ids=p0.layer_ids, dtype="bfloat16", max_seq_len=p0.spec.max_seq_len,
                     tensor_parallel_size=args.tp, storage_dtype=storage, **ENGINE)
    eng.start()
    start = time.time() - t0
    claim_output(p0)
    eng.submit(build_job(p0, 0))
    eng.finish()
    eng.llm.collective_rpc("datagen_step_trace")  # clears the warm-up's steps
    shutil.rmtree(root / "warm", ignore_errors=True)
    groups = [int(g) for g in args.groups.split(",")]
    res: dict = {"engine_start_s": start, "storage": storage, "by_group": {}}
    clock = DriverClock(eng)
    for i in range(cfg["passes"]):
        for g in groups:
            out = root / f"ds-{g}-{i}"
            p = _plan(cfg, out, storage, group=g, tp=args.tp)
            claim_output(p)
            eng.shard_group = g
            eng._last_index = -2  # noqa: SLF001 (a new run: its first shard starts a group)
            clock.take()
            t0 = time.time()
            records = extract_shards(p, eng, range(p.num_shards))
            dt = time.time() - t0
            driver = clock.take()
            write_manifest(p, records)
            r = res["by_group"].setdefault(str(g), {"tokens_per_s": [], "bytes_per_s": [], "bytes": 0, "steps": []})
            r["steps"].append(step_profile(eng, t0, dt, driver))
            r["tokens_per_s"].append(cfg["rows"] * cfg["row_len"] / dt)
            r["bytes_per_s"].append(sum(x.bytes for x in records.values()) / dt)
            r["bytes"] = sum(x.bytes for x in records.values())
            shutil.rmtree(out)
    eng.close()
    return res


def step_profile(eng, t0: float, wall: float, driver: dict | None = None) -> dict:
    """Where a pass's wall time went: the worker's step trace (datagen_step_trace: CPU time of each
    step's execute_model and of the capture, GPU time of the forward and of the capture's kernels)
    and the driver's own time (adding requests, stepping, the write RPCs, the wait for the writers)."""
    trace = next((t for t in eng.llm.collective_rpc("datagen_step_trace") if t is not None), [])
    if not trace:
        return {}
    gaps = sorted(b[0] - a[3] for a, b in zip(trace, trace[1:]))
    gpu_fwd = [x[4] for x in trace if x[4] is not None]
    gpu_cap = [x[5] for x in trace if x[5] is not None]
    out = {"steps": len(trace), "tokens_per_step": statistics.mean(x[2] for x in trace),
           "full_steps": sum(1 for x in trace if x[2] >= ENGINE["max_num_batched_tokens"]),
           "execute_model_cpu_s": sum(x[1] - x[0] for x in trace), "capture_cpu_s": sum(x[3] - x[1] for x in trace),
           "between_steps_s": sum(gaps), "first_to_last_step_s": trace[-1][3] - trace[0][0], "wall_s": wall,
           "gap_ms_median": 1e3 * gaps[len(gaps) // 2] if gaps else 0.0,
           "gap_ms_max": 1e3 * gaps[-1] if gaps else 0.0,
           "gaps_over_5ms": sum(1 for x in gaps if x > 0.005)}
    if gpu_fwd:
        out.update(gpu_forward_s=sum(gpu_fwd) / 1e3, gpu_capture_s=sum(gpu_cap) / 1e3,
                   gpu_forward_ms_per_full_step=_med([x[4] for x in trace if x[2] >= ENGINE["max_num_batched_tokens"]]),
                   gpu_forward_ms_per_step=[round(x[4], 2) for x in trace],
                   tokens_each_step=[x[2] for x in trace])
    if driver:
        out["driver"] = dict(driver)
    return out


class DriverClock:
    """Wall time of the driver's calls into the engine during a pass (wraps the instance's methods)."""

    def __init__(self, eng):
        self.t = {"add_request_s": 0.0, "engine_step_s": 0.0, "rpc_s": 0.0, "finish_wait_s": 0.0}
        core = eng.llm.llm_engine
        self._wrap(core, "add_request", "add_request_s")
        self._wrap(core, "step", "engine_step_s")
        self._wrap(eng.llm, "collective_rpc", "rpc_s")  # the group announcements and the final collect
        self._wrap(eng, "_collect", "finish_wait_s")  # every collect: each second of a group, and the last

    def _wrap(self, obj, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[key] += time.perf_counter() - t0

        setattr(obj, name, timed)

    def take(self) -> dict:
        out, self.t = self.t, dict.fromkeys(self.t, 0.0)
        return out


def stage_connector(args) -> dict:
    """vLLM's extract_hidden_states + ExampleHiddenStatesConnector on the same rows and layers."""
    import glob

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = _cfg(args)
    root = Path(cfg["out_dir"]) / "connector"
    t0 = time.time()
    llm = LLM(model=cfg["model"], skip_tokenizer_init=True, dtype="bfloat16", max_model_len=cfg["row_len"] + 9,
              enable_prefix_caching=False, enable_chunked_prefill=False, seed=0,
              enforce_eager=os.environ.get("DATAGEN_ENFORCE_EAGER") == "1", **ENGINE,
              speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                  "draft_model_config": {"hf_config": {
                                      "eagle_aux_hidden_state_layer_ids": list(cfg["layers"])}}},
              kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                                  "kv_connector_extra_config": {"shared_storage_path": str(root)}})
    start = time.time() - t0
    rows = _rows(cfg["rows"], cfg["row_len"], cfg["vocab"])
    prompts = [TokensPrompt(prompt_token_ids=r.tolist()) for r in rows]
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    locked = [0]

    def wait_written(outs) -> int:
        import fcntl

        total = 0
        for o in outs:
            path = (getattr(o, "kv_transfer_params", None) or {}).get("hidden_states_path")
            if path and os.path.exists(path + ".lock"):
                locked[0] += 1
                with open(path + ".lock") as lf:
                    fcntl.flock(lf, fcntl.LOCK_SH)  # released by the connector's writer once written
            if path and os.path.exists(path):
                total += os.path.getsize(path)
        return total

    wait_written(llm.generate(prompts[: cfg["per_shard"]], sp, use_tqdm=False))
    shutil.rmtree(root, ignore_errors=True)
    rates, written, synced, synced_written = [], [], [], []
    for _ in range(cfg["passes"]):
        t0 = time.time()
        n = wait_written(llm.generate(prompts, sp, use_tqdm=False))
        dt = time.time() - t0
        rates.append(cfg["rows"] * cfg["row_len"] / dt)
        written.append(n / dt)
        os.sync()  # the files on the disk, as the project's fsync'd shards are when a pass ends
        dt = time.time() - t0
        synced.append(cfg["rows"] * cfg["row_len"] / dt)
        synced_written.append(n / dt)
        files = glob.glob(str(root / "**" / "*.safetensors"), recursive=True)
        shutil.rmtree(root, ignore_errors=True)
    llm.llm_engine.engine_core.shutdown()
    return {"tokens_per_s": rates, "bytes_per_s": written, "bytes": n, "files_per_pass": len(files),
            "synced": {"tokens_per_s": synced, "bytes_per_s": synced_written, "bytes": n},
            "engine_start_s": start, "files_waited_on_lock": locked[0],
            "note": "one file per request, written by the connector's threads without fsync"}


def stage_hf(args) -> dict:
    from bench.gpu.timing import sync_device
    from datagen.engines.hf import HFEngine
    from datagen.extraction.output import claim_output
    from datagen.extraction.run import build_job

    cfg = _cfg(args)
    out = Path(cfg["out_dir"]) / "hf"
    p = _plan(cfg, out)
    eng = HFEngine(cfg["model"], layer_ids=p.layer_ids, num_hidden_layers=p.info.num_hidden_layers, dtype="bfloat16")
    t0 = time.time()
    eng.start()
    start = time.time() - t0
    claim_output(p)
    eng.submit(build_job(p, 0))  # warm-up
    eng.finish()
    rates = []
    n = min(p.num_shards, max(1, cfg["hf_shards"]))
    for _ in range(cfg["passes"]):
        sync_device()
        t0 = time.time()
        for k in range(n):
            eng.submit(build_job(p, k))
        eng.finish()
        rates.append(n * cfg["per_shard"] * cfg["row_len"] / (time.time() - t0))
    eng.close()
    shutil.rmtree(out, ignore_errors=True)
    return {"tokens_per_s": rates, "engine_start_s": start, "rows_per_pass": n * cfg["per_shard"]}


STAGES = {"model": stage_model, "disk": stage_disk, "plain": stage_plain, "datagen": stage_datagen,
          "connector": stage_connector, "hf": stage_hf}


# --- the driver ---------------------------------------------------------------------------------

def plan_stages(args, gpus: int) -> list[tuple[str, list[str], dict, float]]:
    """(label, stage argv, environment, expected seconds) in priority order (also the table's order).
    Expected seconds are those measured on the H200 (the first engine start reads the weights)."""
    eager = {"DATAGEN_ENFORCE_EAGER": "1"}
    compiled = {"DATAGEN_ENFORCE_EAGER": "0"}
    streamed = str(args.group or args.rows // args.per_shard)  # shard_group of the streamed passes
    every = streamed if args.streamed_only else f"1,{streamed}"
    s = 1 if args.smoke else 1.0
    kimi = args.shape == "kimi"
    k = 1.6 if kimi else 1.0  # Kimi-width engines start slower (INT4 MoE kernels, a larger graph)
    eager_rows = [
        ("plain eager", ["plain"], eager, 60 * s * k),
        ("datagen bf16 eager", ["datagen", "--storage", "bfloat16", "--groups", every], eager, 75 * s * k),
        ("datagen fp8 eager", ["datagen", "--storage", "fp8_e4m3", "--groups", streamed], eager, 65 * s * k),
        ("connector eager", ["connector"], eager, 70 * s * k),
    ]
    compiled_rows = [
        ("plain compiled", ["plain"], compiled, 100 * s * k),
        ("datagen bf16 compiled", ["datagen", "--storage", "bfloat16", "--groups", streamed], compiled, 100 * s * k),
        ("datagen fp8 compiled", ["datagen", "--storage", "fp8_e4m3", "--groups", streamed], compiled, 90 * s * k),
        ("connector compiled", ["connector"], compiled, 100 * s * k),
    ]
    out = [("model", ["model"], {}, 35 * s), ("disk", ["disk"], {}, 40 * s)]
    if not kimi and args.transformers:
        out.append(("transformers", ["hf"], {}, 25 * s))
    out += compiled_rows + eager_rows if args.compiled_first else eager_rows + compiled_rows
    if gpus >= 2 or args.smoke:
        out += [("plain eager tp2", ["plain", "--tp", "2"], eager, 55 * s),
                ("datagen bf16 eager tp2", ["datagen", "--storage", "bfloat16", "--groups", streamed, "--tp", "2"],
                 eager, 70 * s)]
    if args.smoke and gpus < 2:
        out = [x for x in out if "tp2" not in x[0]]
    if args.only:
        keep = set(args.only.split(","))
        out = [x for x in out if x[0] in keep or x[0] == "model"]
    return out


ORDER = ["model", "disk", "transformers", "plain eager", "datagen bf16 eager", "datagen fp8 eager", "connector eager",
         "plain compiled", "datagen bf16 compiled", "datagen fp8 compiled", "connector compiled", "plain eager tp2",
         "datagen bf16 eager tp2"]


def run_all(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = _rows(args.rows, args.row_len, args.vocab)
    data = work / "rows.jsonl"
    _write_rows(data, rows)
    model = args.model or str(work / ("tiny" if args.smoke else "kimi" if args.shape == "kimi" else "m8b"))
    cfg = {"shape": args.shape, "hidden": 64 if args.smoke else 7168 if args.shape == "kimi" else 4096,
           "model": model, "data": str(data), "rows": args.rows, "row_len": args.row_len, "vocab": args.vocab,
           "per_shard": args.per_shard, "group": args.group, "passes": args.passes, "layers": list(args.layers),
           "hf_shards": args.hf_shards,
           "out_dir": str(Path(args.shards_dir or work / "shards"))}
    (work / "config.json").write_text(json.dumps(cfg))
    try:
        import torch

        gpus = torch.cuda.device_count()
        device = torch.cuda.get_device_name(0) if gpus else "cpu"
    except Exception:  # noqa: BLE001
        gpus, device = 0, "cpu"
    t_start = time.time()
    results: dict = {"config": cfg, "device": device, "gpus": gpus, "stages": {}, "calls": []}
    state = work / "storage-results.json"  # every stage so far: --merge adds this run's stages to it
    if args.merge and state.exists():
        prev = json.loads(state.read_text())
        if prev["config"] != cfg:
            raise SystemExit(f"--merge: {state} was made with another configuration")
        results["stages"], results["calls"] = prev["stages"], prev.get("calls", [])
    results["calls"].append({"argv": sys.argv[1:], "stages": []})

    def save() -> None:
        results["stages"] = {k: results["stages"][k] for k in sorted(
            results["stages"], key=lambda k: ORDER.index(k) if k in ORDER else len(ORDER))}
        for path in (state, out / "storage.json"):
            path.write_text(json.dumps(results, indent=1))
    for label, argv, env, expect in plan_stages(args, gpus):
        if args.skip_done and label != "model" and results["stages"].get(label, {}).get("status") == "ok":
            continue
        left = args.budget - (time.time() - t_start)
        if label.startswith("connector") and not gpus:
            # vLLM's ExampleHiddenStatesConnector copies through pin_memory=True, which torch
            # without an accelerator refuses: its engine dies at the first step on a CPU host
            results["stages"][label] = {"status": "skipped", "why": "vLLM's connector pins host memory: a GPU host only"}
            print(f"[{time.time() - t_start:6.1f}s] {label}: skipped (a GPU host only)", flush=True)
            continue
        if label != "model" and expect > left:
            if results["stages"].get(label, {}).get("status") != "ok":  # keeps an earlier run's record
                results["stages"][label] = {"status": "skipped", "why": f"expected {expect:.0f} s, {left:.0f} s left"}
            print(f"[{time.time() - t_start:6.1f}s] {label}: skipped ({left:.0f} s left)", flush=True)
            continue
        rec = work / f"stage-{label.replace(' ', '_')}.json"  # only three files go to --out
        cmd = [sys.executable, __file__, "stage", *argv, "--work", str(work), "--record", str(rec)]
        if args.smoke:
            cmd.append("--smoke")
        t0 = time.time()
        proc = subprocess.run(cmd, env={**os.environ, **env, "PYTHONUNBUFFERED": "1"}, capture_output=True,
                              text=True, timeout=max(30, left + 30))
        dt = time.time() - t0
        if proc.returncode == 0 and rec.exists():
            r = {"status": "ok", "seconds": dt, **json.loads(rec.read_text())}
        else:
            tail = (proc.stderr or "")[-6000:]
            r = {"status": "failed", "seconds": dt, "exit": proc.returncode, "error": tail}
        results["stages"][label] = r
        results["calls"][-1]["stages"].append(label)
        save()
        print(f"[{time.time() - t_start:6.1f}s] {label}: {r['status']} in {dt:.0f} s "
              f"{summary(label, r)}", flush=True)
        if r["status"] == "failed":
            print("   " + "\n   ".join(r["error"].splitlines()[-6:]), flush=True)
    results["calls"][-1]["seconds"] = time.time() - t_start
    results["seconds"] = sum(c.get("seconds", 0) for c in results["calls"])
    save()
    table = render(results)
    (out / "table.md").write_text(table + "\n")
    print(table, flush=True)
    plot(results, out / "storage.png")
    shutil.rmtree(cfg["out_dir"], ignore_errors=True)
    if args.profile:
        (out / "profile.md").write_text(profile_md(results) + "\n")
        print(profile_md(results), flush=True)


def _med(x) -> float | None:
    return statistics.median(x) if x else None


def summary(label: str, r: dict) -> str:
    if r.get("status") != "ok":
        return ""
    if "by_group" in r:
        return " ".join(f"group {g}: {_med(v['tokens_per_s']):,.0f} tok/s" for g, v in r["by_group"].items())
    if "tokens_per_s" in r:
        return f"{_med(r['tokens_per_s']):,.0f} tok/s"
    if "writer_bytes_per_s" in r:
        return f"dd {r['dd']!r}; writer {r['writer_bytes_per_s'] / 1e9:.2f} GB/s"
    return ""


def rows_of(results: dict) -> list[dict]:
    """One row per measured variant: tokens/s, GB/s written, bytes per token, ratio to plain."""
    st = results["stages"]
    cfg = results["config"]
    tokens = cfg["rows"] * cfg["row_len"]
    plain = {lab.split(" ", 1)[1]: _med(r["tokens_per_s"])
             for lab, r in st.items() if lab.startswith("plain") and r.get("status") == "ok"}
    disk = st.get("disk", {})
    out = []
    for label, r in st.items():
        if label in ("model", "disk"):
            continue
        if r.get("status") != "ok":
            err = (r.get("error") or "").strip().splitlines()
            out.append({"variant": label, "status": r.get("status"), "why": r.get("why") or (err[-1][:160] if err else "")})
            continue
        mode = "eager tp2" if "tp2" in label else "compiled" if "compiled" in label else "eager"
        base = plain.get(mode)
        variants = [(f"{label}, shard_group {g}" if len(r["by_group"]) > 1 else label, v)
                    for g, v in r["by_group"].items()] if "by_group" in r else [(label, r)]
        if r.get("synced"):  # the connector until its files are on the disk (os.sync after each pass)
            variants.append((f"{label}, until on disk (sync)", r["synced"]))
        for name, v in variants:
            tps = _med(v["tokens_per_s"])
            row = {"variant": name, "status": "ok", "tokens_per_s": tps, "plain": base,
                   "vs_plain": (base / tps) if base and tps and not label.startswith("plain") else None}
            if v.get("bytes_per_s"):
                row["gb_per_s"] = _med(v["bytes_per_s"]) / 1e9
            if v.get("bytes"):
                row["bytes_per_token"] = v["bytes"] / tokens
            out.append(row)
    if disk.get("status") == "ok":
        out.append({"variant": "disk: dd oflag=direct", "status": "ok", "gb_per_s": (disk.get("dd_bytes_per_s") or 0) / 1e9})
        out.append({"variant": "disk: shard writer (sha256 + O_DIRECT)" if disk.get("writer_direct")
                    else "disk: shard writer (sha256 + buffered)", "status": "ok",
                    "gb_per_s": disk["writer_bytes_per_s"] / 1e9})
        for where, by in (disk.get("writers") or {}).items():
            for w, rate in by.items():
                out.append({"variant": f"writer alone ({'RAM, /dev/shm' if where == 'ram' else 'disk'}), {w} writers",
                            "status": "ok", "gb_per_s": rate / 1e9})
    return out


def render(results: dict) -> str:
    cfg = results["config"]
    lines = [f"device: {results['device']} x{results['gpus']}; {cfg['rows']} rows x {cfg['row_len']} tokens, layers "
             f"{cfg['layers']}, {cfg['per_shard']} rows per shard, median of {cfg['passes']} passes; "
             f"{results.get('seconds', 0):.0f} s in all", "",
             "| variant | tokens/s | plain / this | written GB/s | bytes/token | goal: min(plain, disk / bytes) x 0.95 |",
             "| --- | --- | --- | --- | --- | --- |"]
    st = results["stages"]
    dd = (st.get("disk", {}).get("dd_bytes_per_s") or 0)
    for r in rows_of(results):
        if r["status"] != "ok":
            lines.append(f"| {r['variant']} | {r['status']}: {r.get('why') or ''} | | | | |")
            continue
        goal = ""
        plain = r.get("plain")
        if r.get("bytes_per_token") and plain and dd:
            bound = min(plain, dd / r["bytes_per_token"])
            goal = f"{0.95 * bound:,.0f} tok/s: {'met' if r['tokens_per_s'] >= 0.95 * bound else 'not met'}"
        lines.append("| {} | {} | {} | {} | {} | {} |".format(
            r["variant"], f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "",
            f"{r['vs_plain']:.3f}x" if r.get("vs_plain") else "",
            f"{r['gb_per_s']:.2f}" if r.get("gb_per_s") else "",
            f"{r['bytes_per_token']:,.0f}" if r.get("bytes_per_token") else "", goal))
    return "\n".join(lines)


def profile_md(results: dict) -> str:
    """Per datagen variant, its median pass (by wall time): where the time went."""
    cfg = results["config"]
    tokens = cfg["rows"] * cfg["row_len"]
    st = results["stages"]
    lines = ["| variant | wall s | plain s | steps (full) | tokens/step | GPU forward s | GPU capture s | GPU idle s "
             "| before first / after last step s | between steps s (median gap ms) | execute_model + capture CPU s "
             "| driver: step / add / RPC / collects s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for label, r in st.items():
        if r.get("status") != "ok" or "by_group" not in r:
            continue
        mode = "eager tp2" if "tp2" in label else "compiled" if "compiled" in label else "eager"
        plain = _med(st.get(f"plain {mode}", {}).get("tokens_per_s") or [])
        for g, v in r["by_group"].items():
            passes = [x for x in v["steps"] if x]
            if not passes:
                continue
            x = sorted(passes, key=lambda q: q["wall_s"])[len(passes) // 2]
            d = x.get("driver", {})
            fwd, cap = x.get("gpu_forward_s"), x.get("gpu_capture_s")
            idle = x["wall_s"] - fwd - cap if fwd is not None else None
            f = (lambda q: f"{q:.2f}" if q is not None else "")
            lines.append(" | ".join([
                f"| {label}, group {g}", f(x["wall_s"]), f(tokens / plain if plain else None),
                f"{x['steps']} ({x.get('full_steps', '')})", f"{x['tokens_per_step']:,.0f}", f(fwd), f(cap), f(idle),
                f(x["wall_s"] - x["first_to_last_step_s"]),
                f"{x['between_steps_s']:.2f} ({x['gap_ms_median']:.1f})",
                f"{x['execute_model_cpu_s']:.2f} + {x['capture_cpu_s']:.2f}",
                " / ".join(f(d.get(k)) for k in ("engine_step_s", "add_request_s", "rpc_s", "finish_wait_s")),
            ]) + " |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in rows_of(results) if r["status"] == "ok" and r.get("tokens_per_s")]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    ax.barh([r["variant"] for r in rows], [r["tokens_per_s"] for r in rows], color="tab:blue")
    dd = results["stages"].get("disk", {}).get("dd_bytes_per_s")
    for bpt in sorted({round(r["bytes_per_token"]) for r in rows if r.get("bytes_per_token")}):
        if dd:  # the disk's bound at this many bytes per token
            ax.axvline(dd / bpt, ls="--", color="tab:red")
            ax.text(dd / bpt, -0.6, f" disk / {bpt:,} B", color="tab:red", fontsize=8)
    ax.set_xlabel("tokens/s (median)")
    ax.invert_yaxis()
    ax.set_title(f"extraction at the storage limit ({results['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    st = sub.add_parser("stage")
    st.add_argument("name", choices=sorted(STAGES))
    st.add_argument("--work", required=True)
    st.add_argument("--record", required=True)
    st.add_argument("--storage", default="bfloat16")
    st.add_argument("--groups", default="1")
    st.add_argument("--tp", type=int, default=1)
    st.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "storagebench"))
    ap.add_argument("--shards-dir", help="where shards are written (default: under --work)")
    ap.add_argument("--model", help="model directory (default: build a random 8B Llama under --work)")
    ap.add_argument("--rows", type=int, help="rows per pass (default 256; --smoke: 12)")
    ap.add_argument("--row-len", type=int, help=f"tokens per row (default {ROW_LEN}; --smoke: 128)")
    ap.add_argument("--per-shard", type=int, help="rows per shard (default 8: 8 x 1024 tokens x 32 KB = 0.27 GB; "
                    "--smoke: 4)")
    ap.add_argument("--passes", type=int, help="timed passes per variant (default 3; --smoke: 2)")
    ap.add_argument("--hf-shards", type=int, default=1)
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for all stages (a stage that would not "
                    "fit is skipped)")
    ap.add_argument("--only", help="comma-separated stage labels")
    ap.add_argument("--merge", action="store_true", help="add this run's stages to those of earlier runs with the "
                    "same --work and configuration (one table over several device calls)")
    ap.add_argument("--streamed-only", action="store_true", help="datagen bf16 eager: the streamed pass alone "
                    "(no shard_group 1 passes)")
    ap.add_argument("--skip-done", action="store_true", help="with --merge: leave out the stages already measured")
    ap.add_argument("--profile", action="store_true", help="also write profile.md: where each datagen pass's "
                    "time went (steps, GPU time of forward and capture, gaps, driver calls)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, few rows: every code path on any machine")
    ap.add_argument("--shape", choices=["8b", "kimi"], default="8b", help="the model (see the module doc)")
    ap.add_argument("--compiled-first", action="store_true", help="compiled rows before eager ones")
    ap.add_argument("--transformers", action="store_true", help="also the reference engine (8b)")
    ap.add_argument("--group", type=int, help="shard_group of the streamed passes (default: all shards of a pass in "
                    "one group; fewer makes a pass of several groups, as a production run is)")
    args = ap.parse_args()
    if args.cmd == "stage":
        rec = STAGES[args.name](args)
        Path(args.record).write_text(json.dumps(rec))
        return
    kimi = args.shape == "kimi" and not args.smoke
    args.vocab = 500 if args.smoke else KIMI_VOCAB if kimi else 128256
    args.layers = (2, 3, 6) if args.smoke else LAYERS_KIMI if kimi else LAYERS_8B
    defaults = (12, 128, 4, 2) if args.smoke else (256, ROW_LEN, 8, 3)
    for name, value in zip(("rows", "row_len", "per_shard", "passes"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.smoke:
        args.budget = max(args.budget, 3600)
    run_all(args)


if __name__ == "__main__":
    main()
