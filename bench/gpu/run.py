"""The GPU bench drives the product: `datagen extract` as the README says it, the `extract/kimi`
deployment's spec through the flow's extract step, plain vLLM prefill on the same engine settings,
and the disk bound; one JSON per stage, one table and one plot.

Here (prefect installed), once, whenever prefect.yaml's `kimi` deployment changes:

    python bench/gpu/run.py spec            # bench/gpu/deploy-kimi.json: the extract step's spec of `kimi`

On the GPU machine (bench/gpu/README.md says how vLLM gets there), each in a call of its own:

    python3 bench/gpu/run.py make --shape kimi --work /tmp/gb     # the checkpoint and the rows (no vLLM)
    python3 bench/gpu/run.py run --shape kimi --work /tmp/gb --out $OUT --budget 540 \
        --stages disk,cli-fp8,plain,cli-bf16,deploy
    python3 bench/gpu/run.py report --results $OUT                # table.md, table.png, bench.json

Anywhere, on the CPU engine: ``--shape tiny --rows 8 --row-len 64`` (the smoke).

``run --trace``: the product's commands also write their engine's steps (DATAGEN_STEP_TRACE, with
DATAGEN_GPU_STEP_TIMES=1 for the GPU times), and each record gets ``start``: where the run's start
went (the "engine started" line to the first step, the first steps against the run's median step,
the first shard's rows computed, its file written).

Stages (each in a process of its own, under a timeout; a failure is recorded with its log tail):

  cli-bf16, cli-fp8  ``python -m datagen extract --model M --dataset D --out O`` and nothing else but
                     ``--storage-dtype fp8_e4m3`` for fp8 and ``--tensor-parallel-size N`` when N > 1
                     GPUs are visible: the README's command with every default
  deploy             prefect.yaml's `kimi` spec as tasks/pipeline_spec.py turns it into the extract
                     step's spec (bench/gpu/deploy-kimi.json, made here by ``spec``), with the model,
                     dataset, output and tensor parallel size replaced, run as the flow's local runner
                     runs it: ``datagen plan --spec``, then the plan it made given to ``datagen
                     extract`` for each range of ``shards_per_task`` shards (the range call's spec file
                     and environment), then to the finalize that writes the manifest; ``deploy-fp8`` the same
                     with the spec's storage dtype fp8_e4m3
  plain              plain vLLM prefill (``bench.gpu.timing.plain_prefill``) on the engine arguments
                     the default command's plan gives (``VllmSettings.from_plan``) less the capture;
                     also on the deployment's, where those differ
  disk               ``dd if=/dev/zero bs=64M oflag=direct`` onto the output's volume

Steady rate: the tokens over the time from the first token handed to the engine to the last shard
written, measured by the driver: from the arrival of the product's "engine started" line (its first
progress line where none says it) to the newest shard file's modification time. The product's own
figure (its last progress line: tokens since the first token) is kept beside it, as a check on the
progress the user sees: before 8c064ea that line counted tokens as they were handed to the engine,
not as their shards were written, and said 59,033 tokens/s where the driver measured 38,667
(results/issue56-first). Both are kept, with the command's wall time and the engine's start.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.gpu.models import VOCAB, build, write_rows  # noqa: E402

DEPLOY_SPEC = REPO / "bench" / "gpu" / "deploy-kimi.json"
FP8 = "fp8_e4m3"
# expected seconds of each stage (a compiled engine's start included), for --budget
EXPECT = {"kimi": {"disk": 30, "cli-fp8": 240, "cli-bf16": 200, "deploy": 230, "deploy-fp8": 230, "plain": 230,
                   "plain-deploy": 230},
          "8b": {"disk": 30, "cli-fp8": 150, "cli-bf16": 170, "deploy": 170, "deploy-fp8": 150, "plain": 160,
                   "plain-deploy": 160},
          "tiny": {"disk": 5, "cli-fp8": 90, "cli-bf16": 90, "deploy": 150, "deploy-fp8": 150, "plain": 90,
                   "plain-deploy": 90}}


# --- here: the deployment's spec ----------------------------------------------------------------

def make_spec(args) -> None:
    """prefect.yaml's `kimi` parameters -> PipelineSpec -> the extract step's spec (as the flow makes it),
    with placeholders for the model, dataset, output and tensor parallel size the device fills in."""
    import yaml

    from tasks.extract import range_env
    from tasks.media import media_step_env
    from tasks.pipeline_spec import parse_pipeline_spec

    deployments = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    raw = next(d for d in deployments if d["name"] == args.deployment)["parameters"]["spec"]
    changed = {"model": "/bench/model", "dataset": "/bench/rows.jsonl", "output": "/bench/out"}
    raw = {**raw, **changed, "engine": {**raw.get("engine", {}), "tensor_parallel_size": 1}}
    # the deployment's layers are Kimi-K2.5's 61-layer set; the bench's checkpoints have 8 or 32 layers:
    # the same rule ([2, N//2, N-3, N], the spec's default) picks theirs
    layers = raw.pop("layer_ids", None)
    spec = parse_pipeline_spec(raw)
    xspec = spec.extract_spec(model_dir=changed["model"], model_revision=None)
    doc = {"deployment": args.deployment, "deployment_parameters": raw | {"layer_ids": layers},
           "changed": sorted([*changed, "engine.tensor_parallel_size", "layer_ids (the model's EAGLE-3 default)",
                              "model_revision (None: no download step)"]),
           "extract_spec": xspec.model_dump(mode="json"), "shards_per_task": spec.shards_per_task,
           "range_env": range_env(media_step_env(xspec.dataset)), "placeholders": changed}
    Path(args.path).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.path}: {json.dumps(doc['extract_spec'], sort_keys=True)}")


# --- the device: checkpoints and rows -----------------------------------------------------------

def _paths(work: Path, shape: str) -> tuple[Path, Path]:
    return work / shape / "model", work / shape / "rows.jsonl"


def make(args) -> None:
    work = Path(args.work)
    model, rows = _paths(work, args.shape)
    model.parent.mkdir(parents=True, exist_ok=True)
    rec = build(args.shape, model)
    tokens = write_rows(rows, args.rows, args.row_len, VOCAB[args.shape])
    print(json.dumps({**rec, "rows": args.rows, "row_len": args.row_len, "tokens": tokens}), flush=True)


# --- a command, line by line, timed ---------------------------------------------------------------

def _run_cmd(cmd: list[str], env: dict, log, timeout: float) -> dict:
    """Run ``cmd`` (its own process group), each output line stamped with its arrival time."""
    t0 = time.time()
    lines: list[tuple[float, str]] = []
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            text=True, errors="replace", bufsize=1, start_new_session=True, cwd=REPO)
    deadline = t0 + timeout
    try:
        for line in proc.stdout:
            now = time.time()
            lines.append((now - t0, line.rstrip("\n")))
            log.write(f"{now - t0:8.2f} {line}")
            if now > deadline:
                raise TimeoutError
        rc = proc.wait(timeout=max(1.0, deadline - time.time()))
    except (TimeoutError, subprocess.TimeoutExpired):
        rc = "timeout"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    log.flush()
    result = next((json.loads(l[len("datagen-result: "):]) for _, l in reversed(lines)
                   if l.startswith("datagen-result: ")), None)
    return {"cmd": cmd, "rc": rc, "t0": t0, "wall_s": round(time.time() - t0, 2), "lines": lines, "result": result}


PROGRESS = re.compile(r"\bprogress\b", re.I)
RATE = re.compile(r"([\d][\d,]*(?:\.\d+)?)\s*(k?)\s*tokens/s", re.I)
ENGINE_START = re.compile(r"engine\b[^\n]*?\bstart\w*\b[^\n]*?\b(?:in\s+)?([\d.]+)\s*s\b", re.I)


def _num(m: re.Match) -> float:
    return float(m.group(1).replace(",", "")) * (1000.0 if m.group(2).lower() == "k" else 1.0)


def _measure(runs: list[dict], out_dir: Path, tokens: int) -> dict:
    """The steady rate and the rest, from a stage's commands (the last one wrote the manifest)."""
    all_lines = [(r["t0"] + t, l) for r in runs for t, l in r["lines"]]
    prog = [(t, l) for t, l in all_lines if PROGRESS.search(l) and " INFO " in l]
    shards = list((out_dir / "shards").glob("*.safetensors")) if out_dir.exists() else []
    rec: dict = {"wall_s": round(sum(r["wall_s"] for r in runs), 2), "rc": [r["rc"] for r in runs],
                 "shards": len(shards), "tokens": tokens,
                 "progress_lines": [l for _, l in prog][:3] + ([l for _, l in prog][-3:] if len(prog) > 3 else []),
                 "engine_lines": [l for _, l in all_lines if ENGINE_START.search(l) and " INFO " in l][:4]}
    res = next((r["result"] for r in reversed(runs) if r["result"]), None)
    extracted = [r["result"] for r in runs if r["result"] and r["result"].get("tokens_extracted")]
    if extracted:
        rec["tokens"] = tokens = sum(r["tokens_extracted"] for r in extracted)
        rec["result_tokens_per_s"] = [r.get("tokens_per_s") for r in extracted]
        rec["step_seconds"] = [r.get("seconds") for r in extracted]
    if res:
        rec["bytes"] = res.get("bytes") or (res.get("totals") or {}).get("bytes")
        rec["engine"] = res.get("engine")
        rec["layer_ids"] = res.get("layer_ids")
        rec["shards_total"] = res.get("shards_total")
    if rec.get("bytes") and tokens:
        rec["bytes_per_token"] = rec["bytes"] / tokens
    # the first token handed over: the product's "engine started" line, else its first progress line
    started = [t for t, l in all_lines if ENGINE_START.search(l) and " INFO " in l]
    t_first = started[0] if started else prog[0][0] if prog else None
    if shards and t_first is not None:
        t_last = max(p.stat().st_mtime for p in shards)
        rec["first_token_s"] = round(t_first - runs[0]["t0"], 2)
        rec["last_shard_s"] = round(t_last - runs[0]["t0"], 2)
        rec["steady_driver"] = tokens / max(t_last - t_first, 1e-6)
        if rec.get("bytes"):
            rec["bytes_per_s_driver"] = rec["bytes"] / max(t_last - t_first, 1e-6)
        try:
            listed = json.loads((out_dir / "manifest.json").read_text())["shards"]
        except (OSError, KeyError, ValueError):
            listed = []
        rec.update(_past_fill(listed, shards))
        rec.update(_start(out_dir, t_first, listed, shards))
    if prog:
        last = prog[-1][1]
        rates = list(RATE.finditer(last))
        if rates and re.search(r"first token|since", last, re.I):
            rec["steady_product"] = _num(rates[0])
    for _, l in all_lines:
        m = ENGINE_START.search(l)
        if m and " INFO " in l:
            rec["engine_start_s"] = float(m.group(1))
            break
    else:
        if prog:  # no line says it: the time to the first progress line (planning included)
            rec["engine_start_s_to_first_progress"] = rec.get("first_progress_s")
    rec["steady_tokens_per_s"] = rec.get("steady_driver") or rec.get("steady_product")
    rec["steady_source"] = "driver" if rec.get("steady_driver") else "product" if rec.get("steady_product") else None
    return rec


def _past_fill(listed: list[dict], shards: list[Path]) -> dict:
    """The rate past the pipeline's fill: the tokens of every shard but the first written, over the
    time from the first shard file written to the last (their modification times; each shard's
    tokens from the manifest). The steady window from the engine's start opens with the fill (no
    token counts until the first shard's rows are computed and written), which a short run pays in
    full and a long one not at all. ``listed``: the manifest's shards."""
    tokens = {Path(s["path"]).name: s["tokens"] for s in listed}
    written = sorted((p.stat().st_mtime, tokens[p.name]) for p in shards if p.name in tokens)
    if len(written) < 3:
        return {}
    span = written[-1][0] - written[0][0]
    return {"past_fill_shards": len(written) - 1, "past_fill_s": round(span, 2),
            "past_fill_tokens": sum(t for _, t in written[1:]),
            "past_fill_tokens_per_s": sum(t for _, t in written[1:]) / max(span, 1e-6)}


def _env() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


TRACE = False  # stage --trace: the product's commands write their engine's steps


def _traced(env: dict, out: Path, start: bool = True) -> dict:
    """``env`` with the step trace asked for, beside ``out`` (which the stage removes), under ``--trace``
    for the command that holds the run's start (a deployment's first range)."""
    if not (TRACE and start):
        return env
    _trace_file(out).unlink(missing_ok=True)
    return {**env, "DATAGEN_STEP_TRACE": str(_trace_file(out)), "DATAGEN_GPU_STEP_TIMES": "1"}


def _trace_file(out: Path) -> Path:
    return out.with_name(out.name + ".steps.json")


def _start(out_dir: Path, t_first: float, listed: list[dict], shards: list[Path]) -> dict:
    """Where the run's start went, from its engine's steps (``--trace``), in seconds after the
    product's "engine started" line: its first step, the first shard's rows computed (the steps'
    tokens counted up to the first shard's, the rows being scheduled in their order), and the first
    shard's file written; the first 5 steps' seconds beside the run's median step."""
    try:
        steps = json.loads(_trace_file(out_dir).read_text())["steps"]
    except (OSError, KeyError, ValueError):
        return {}
    if not listed:
        return {}
    first = min(listed, key=lambda x: x["index"])
    files = {p.name: p for p in shards}
    if not steps or Path(first["path"]).name not in files:
        return {}
    done, n = None, 0
    for st in steps:
        n += st["tokens"]
        if n >= first["tokens"]:
            done = st["captured"]
            break
    secs = [st["end"] - st["start"] for st in steps]
    return {"start": {"first_step_s": round(steps[0]["start"] - t_first, 3),
                      "first_shard_rows_computed_s": round(done - t_first, 3) if done else None,
                      "first_shard_written_s": round(files[Path(first["path"]).name].stat().st_mtime - t_first, 3),
                      "first_shard_tokens": first["tokens"], "first_steps_s": [round(x, 4) for x in secs[:5]],
                      "step_median_s": round(statistics.median(secs), 4), "steps": len(steps),
                      "first_steps_forward_gpu_ms": [st["forward_gpu_ms"] for st in steps[:5]]}}


def _tp() -> int:
    try:
        import torch

        return max(1, torch.cuda.device_count())
    except Exception:  # noqa: BLE001
        return 1


# --- stages --------------------------------------------------------------------------------------

def stage_cli(work: Path, shape: str, dtype: str, log, timeout: float) -> dict:
    model, _ = _paths(work, shape)
    rows = _rows_that_fit(work, shape, dtype)
    out = work / "runs" / f"{shape}-cli-{dtype}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "datagen", "extract", "--model", str(model), "--dataset", str(rows), "--out", str(out)]
    if dtype == "fp8":
        cmd += ["--storage-dtype", FP8]
    if _tp() > 1:
        cmd += ["--tensor-parallel-size", str(_tp())]
    r = _run_cmd(cmd, _traced(_env(), out), log, timeout)
    rec = {"command": " ".join(["datagen", *cmd[3:]]), "rows_file": rows.name, **_measure([r], out, _row_tokens(rows))}
    if r["rc"] != 0:
        rec["error_tail"] = [l for _, l in r["lines"][-25:]]
    shutil.rmtree(out, ignore_errors=True)
    return rec


def _rows_that_fit(work: Path, shape: str, dtype: str) -> Path:
    """The rows file, or its first rows where the whole run's states would not fit the volume (Kimi's
    width in bf16: 1,024 x 1,024 tokens are 60 GB; 8 GB are left free)."""
    model, rows = _paths(work, shape)
    cfg = json.loads((model / "config.json").read_text())
    hidden = (cfg.get("text_config") or {}).get("hidden_size") or cfg["hidden_size"]
    lines = [l for l in rows.read_text().splitlines() if l.strip()]
    per_row = len(json.loads(lines[0])["input_ids"]) * 4 * hidden * (1 if dtype == "fp8" else 2)
    (work / "runs").mkdir(parents=True, exist_ok=True)
    fit = int((shutil.disk_usage(work / "runs").free - 8e9) // per_row)
    if fit >= len(lines):
        return rows
    n = max(64, fit // 64 * 64)
    part = rows.with_name(f"rows-{n}.jsonl")
    part.write_text("\n".join(lines[:n]) + "\n")
    return part


def _row_tokens(rows: Path) -> int:
    with rows.open() as f:
        return sum(len(json.loads(l)["input_ids"]) for l in f if l.strip())


def _deploy_spec(work: Path, shape: str, dtype: str) -> tuple[dict, dict, Path]:
    doc = json.loads(DEPLOY_SPEC.read_text())
    model, _ = _paths(work, shape)
    rows = _rows_that_fit(work, shape, dtype)
    out = work / "runs" / f"{shape}-deploy-{dtype}"
    spec = dict(doc["extract_spec"], model=str(model), dataset=str(rows), out=str(out))
    spec["engine"] = dict(spec["engine"], tensor_parallel_size=_tp())
    if dtype == "fp8":
        spec["engine"]["storage_dtype"] = FP8
    doc = dict(doc, changed=list(doc["changed"]))
    pos = _positions(model)
    if spec.get("max_seq_len") and pos and spec["max_seq_len"] >= pos:  # refused as it is: the longest that fits
        spec["max_seq_len"] = pos - 1
        doc["changed"].append(f"max_seq_len {doc['extract_spec']['max_seq_len']} -> {pos - 1} (the model's positions)")
    return doc, spec, out


def _positions(model: Path) -> int | None:
    cfg = json.loads((model / "config.json").read_text())
    return (cfg.get("text_config") or {}).get("max_position_embeddings") or cfg.get("max_position_embeddings")


def stage_deploy(work: Path, shape: str, dtype: str, log, timeout: float) -> dict:
    doc, spec, out = _deploy_spec(work, shape, dtype)
    shutil.rmtree(out, ignore_errors=True)
    sdir = work / "runs" / "specs"
    sdir.mkdir(parents=True, exist_ok=True)
    whole = sdir / f"{shape}-{dtype}.json"
    whole.write_text(json.dumps(spec))
    t_end = time.time() + timeout
    py = [sys.executable, "-m", "datagen"]
    runs = [_run_cmd([*py, "plan", "--spec", str(whole)], _env(), log, timeout)]
    n = (runs[0]["result"] or {}).get("num_shards")
    rec: dict = {"spec": spec, "changed": doc["changed"], "num_shards": n, "rows_file": Path(spec["dataset"]).name}
    print(json.dumps({"deploy spec": spec, "changed": doc["changed"]}), file=log, flush=True)
    if not n:
        return {**rec, "rc": [runs[0]["rc"]], "error_tail": [l for _, l in runs[0]["lines"][-25:]]}
    # the flow's calls: each range and the finalize given the plan `datagen plan` made (tasks/extract.py:
    # range_call, finalize_call), in the step's spec file as the local runner writes it
    made = runs[0]["result"]["plan"]
    step = doc["shards_per_task"]
    ranges = [(a, min(a + step, n)) for a in range(0, n, step)]
    for a, b in ranges:
        rs = sdir / f"{shape}-{dtype}-{a}-{b}.json"
        rs.write_text(json.dumps({"plan": made, "shards": [a, b]}))
        runs.append(_run_cmd([*py, "extract", "--spec", str(rs)], _traced({**_env(), **doc["range_env"]}, out, a == 0), log,
                             t_end - time.time()))
    fin = sdir / f"{shape}-{dtype}-finalize.json"
    fin.write_text(json.dumps({"plan": made}))
    runs.append(_run_cmd([*py, "extract", "--spec", str(fin)], _env(), log, max(10.0, t_end - time.time())))
    rec.update(commands=[" ".join(["datagen", *r["cmd"][3:]]) for r in runs], ranges=ranges,
               range_env=doc["range_env"], **_measure(runs[1:], out, _row_tokens(Path(spec["dataset"]))))
    rec["plan_wall_s"] = runs[0]["wall_s"]
    rec["wall_s"] = round(sum(r["wall_s"] for r in runs), 2)
    if any(r["rc"] != 0 for r in runs):
        rec["error_tail"] = [l for r in runs if r["rc"] != 0 for _, l in r["lines"][-25:]]
    shutil.rmtree(out, ignore_errors=True)
    return rec


def _engine(spec: dict):
    from datagen.specs.extraction import parse_spec
    from datagen.engines.vllm_engine import VllmEngine
    from datagen.engines.vllm_settings import VllmSettings
    from datagen.extraction.plan import plan

    p = plan(parse_spec(spec))
    return VllmEngine(p.info, VllmSettings.from_plan(p))


def stage_plain(work: Path, shape: str, args, which: str = "cli") -> dict:
    """In this process: plain prefill on the default command's engine arguments (``which`` "cli") or
    the deployment's ("deploy": nothing run where they equal the default command's)."""
    from vllm.inputs import TokensPrompt

    from bench.gpu.timing import plain_prefill

    model, rows = _paths(work, shape)
    ids = [json.loads(l)["input_ids"] for l in rows.open() if l.strip()]
    prompts = [TokensPrompt(prompt_token_ids=r) for r in ids]
    tokens = sum(map(len, ids))
    cli = {"model": str(model), "dataset": str(rows), "out": str(work / "runs" / "plain")}
    if _tp() > 1:
        cli["engine"] = {"tensor_parallel_size": _tp()}
    engines = {"cli": _engine(cli)}
    if DEPLOY_SPEC.exists():
        engines["deploy"] = _engine(_deploy_spec(work, shape, "bf16")[1])
    kw = {k: _plain_kwargs(e) for k, e in engines.items()}
    rec: dict = {"engine_kwargs": kw, "settings": which}
    if which == "deploy":
        diff = {k: [kw["cli"].get(k), kw["deploy"].get(k)] for k in sorted(set(kw["cli"]) | set(kw["deploy"]))
                if kw["cli"].get(k) != kw["deploy"].get(k)}
        rec["differs_from_cli"] = diff
        if not diff:
            return {**rec, "same_as": "cli"}
    rates, start = plain_prefill(engines[which], prompts, tokens=tokens, repeats=args.repeats,
                                 warmup=min(64, len(prompts)), until="synced")
    return {**rec, "tokens_per_s": rates, "median": statistics.median(rates), "engine_start_s": round(start, 1)}


def _plain_kwargs(eng) -> dict:
    """The LLM arguments plain prefill runs with (timing.plain_prefill drops the capture's two)."""
    kw = _jsonable(eng.engine_kwargs())
    kw.pop("worker_extension_cls", None)
    kw.pop("additional_config", None)
    return kw


def _jsonable(d: dict) -> dict:
    return json.loads(json.dumps(d, default=str))


def stage_disk(work: Path, shape: str, args) -> dict:
    d = work / "runs"
    d.mkdir(parents=True, exist_ok=True)
    mb = args.disk_mib
    count = max(1, mb // 64)
    target = d / "dd.bin"
    proc = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=64M", f"count={count}", "oflag=direct"],
                          capture_output=True, text=True)
    target.unlink(missing_ok=True)
    line = (proc.stderr.strip().splitlines() or [""])[-1]
    m = re.search(r"^(\d+) bytes.*copied, ([\d.]+) s", line)
    rate = int(m.group(1)) / float(m.group(2)) if m else None
    free = shutil.disk_usage(d)
    return {"dd": line, "bytes_per_s": rate, "bytes": count << 26, "volume_free_gb": round(free.free / 1e9, 1)}


def stage(args) -> None:
    """One stage in this process; its record to --record."""
    global TRACE
    TRACE = args.trace
    work = Path(args.work)
    with open(args.log, "a") as log:
        name = args.name
        t0 = time.time()
        if name.startswith("cli-"):
            rec = stage_cli(work, args.shape, name[4:], log, args.timeout)
        elif name.startswith("deploy"):
            rec = stage_deploy(work, args.shape, "fp8" if name.endswith("fp8") else "bf16", log, args.timeout)
        elif name in ("plain", "plain-deploy"):
            rec = stage_plain(work, args.shape, args, "cli" if name == "plain" else "deploy")
        elif name == "disk":
            rec = stage_disk(work, args.shape, args)
        else:
            raise SystemExit(f"unknown stage {name}")
    rec.update(stage=name, shape=args.shape, seconds=round(time.time() - t0, 1))
    Path(args.record).write_text(json.dumps(rec, indent=1, default=str))


def _device() -> dict:
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        q = []
    try:
        import vllm

        v = vllm.__version__
    except Exception:  # noqa: BLE001
        v = None
    return {"gpus": q or ["cpu"], "vllm": v}


def run_all(args) -> None:
    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    dev = _device()
    for name in [s for s in args.stages.split(",") if s]:
        need = EXPECT[args.shape].get(name, 120)
        left = args.budget - (time.time() - t_start)
        path = out / f"{args.shape}-{name}.json"
        if left < need:
            print(f"{name}: skipped ({left:.0f} s left of --budget, needs about {need} s)", flush=True)
            path.write_text(json.dumps({"stage": name, "shape": args.shape, "skipped": f"{left:.0f} s left"}))
            continue
        log = out / f"{args.shape}-{name}.log"
        cmd = [sys.executable, __file__, "stage", name, "--shape", args.shape, "--work", str(work), "--record", str(path),
               "--log", str(log), "--timeout", str(max(30.0, left - 15)), "--repeats", str(args.repeats),
               "--disk-mib", str(args.disk_mib)] + (["--trace"] if args.trace else [])
        print(f"{name}: started ({left:.0f} s left)", flush=True)
        t0 = time.time()
        with log.open("a") as lf:
            r = _run_cmd(cmd, _env(), lf, max(30.0, left - 5))
        if not path.exists():
            path.write_text(json.dumps({"stage": name, "shape": args.shape, "failed": r["rc"],
                                        "error_tail": [l for _, l in r["lines"][-30:]]}, indent=1))
        rec = json.loads(path.read_text())
        rec["device"] = dev
        path.write_text(json.dumps(rec, indent=1, default=str))
        print(f"{name}: {time.time() - t0:.0f} s, " + json.dumps(_brief(rec)), flush=True)


def _brief(rec: dict) -> dict:
    keys = ("rc", "failed", "steady_tokens_per_s", "steady_source", "wall_s", "engine_start_s",
            "engine_start_s_to_first_progress", "shards", "bytes_per_token", "bytes_per_s", "dd")
    b = {k: rec[k] for k in keys if k in rec}
    for k in ("median", "same_as", "differs_from_cli"):
        if k in rec:
            b[k] = rec[k]
    return b


# --- the table ------------------------------------------------------------------------------------

def report(args) -> None:
    res = Path(args.results)
    recs = {}
    for p in sorted(res.glob("*.json")):
        try:
            r = json.loads(p.read_text())
        except json.JSONDecodeError:
            continue
        if "stage" in r and "shape" in r:
            recs[(r["shape"], r["stage"])] = r
    (res / "bench.json").write_text(json.dumps({f"{s}/{n}": r for (s, n), r in recs.items()}, indent=1, default=str))
    lines = ["| shape | storage | default command tok/s | deployment spec tok/s | plain prefill tok/s | disk bound tok/s "
             "| default / plain | default / disk | default / min | deployment / min | default: wall s, engine start s "
             "| deployment: wall s | default: progress line says | default past the fill tok/s (/ min) |", "| --- " * 14 + "|"]
    rows = []
    for shape in ("kimi", "8b", "tiny"):
        if not any(k[0] == shape for k in recs):
            continue
        plain = recs.get((shape, "plain"), {}).get("median")
        pd = recs.get((shape, "plain-deploy"), {})
        # the deployment's own engine arguments when its plain stage ran, else the default command's
        plain_dep = pd.get("median") or plain
        disk = recs.get((shape, "disk")) or recs.get(("kimi", "disk")) or {}
        for dtype in ("fp8", "bf16"):
            cli = recs.get((shape, f"cli-{dtype}"), {})
            dep = recs.get((shape, f"deploy-{dtype}") if dtype == "fp8" else (shape, "deploy"), {})
            c, d = _steady(cli), _steady(dep)
            bpt = cli.get("bytes_per_token") or dep.get("bytes_per_token")
            dbound = disk["bytes_per_s"] / bpt if disk.get("bytes_per_s") and bpt else None
            mins = [x for x in (plain, dbound) if x]
            mn = min(mins) if mins else None
            dmins = [x for x in (plain_dep, dbound) if x]
            rows.append({"shape": shape, "storage": dtype, "cli": c, "deploy": d, "plain": plain, "plain_deploy": plain_dep,
                         "disk": dbound, "cli_wall_s": cli.get("wall_s"),
                         "cli_engine_start_s": cli.get("engine_start_s", cli.get("engine_start_s_to_first_progress")),
                         "deploy_wall_s": dep.get("wall_s"), "cli_vs_plain": _ratio(c, plain), "cli_vs_disk": _ratio(c, dbound),
                         "cli_vs_min": _ratio(c, mn), "deploy_vs_min": _ratio(d, min(dmins) if dmins else None),
                         "cli_failed": _failed(cli), "deploy_failed": _failed(dep), "cli_progress_line": cli.get("steady_product"),
                         "cli_past_fill": cli.get("past_fill_tokens_per_s"),
                         "cli_past_fill_vs_min": _ratio(cli.get("past_fill_tokens_per_s"), mn)})
    for r in rows:
        lines.append(f"| {r['shape']} | {r['storage']} | {_fmt(r['cli'], r['cli_failed'])} | {_fmt(r['deploy'], r['deploy_failed'])} "
                     f"| {_fmt(r['plain'])} | {_fmt(r['disk'])} | {_fr(r['cli_vs_plain'])} | {_fr(r['cli_vs_disk'])} "
                     f"| {_fr(r['cli_vs_min'])} | {_fr(r['deploy_vs_min'])} | {_fmt(r['cli_wall_s'])}, {_fmt(r['cli_engine_start_s'])} "
                     f"| {_fmt(r['deploy_wall_s'])} | {_fmt(r['cli_progress_line'])} "
                     f"| {_fmt(r['cli_past_fill'])} ({_fr(r['cli_past_fill_vs_min'])}) |")
    dev = next((r.get("device") for r in recs.values() if r.get("device")), {})
    lines += ["", f"device: {', '.join(dev.get('gpus', []))}; vLLM {dev.get('vllm')}"]
    traced = [(k, r["start"]) for k, r in sorted(recs.items()) if r.get("start")]
    if traced:  # run --trace: seconds after the "engine started" line
        lines += ["", "| shape | stage | first step s | first shard's rows computed s | first shard written s "
                      "| first 5 steps s | median step s |", "| --- " * 7 + "|"]
        lines += [f"| {s} | {n} | {t['first_step_s']} | {t['first_shard_rows_computed_s']} | {t['first_shard_written_s']} "
                  f"| {' / '.join(str(x) for x in t['first_steps_s'])} | {t['step_median_s']} |" for (s, n), t in traced]
    (res / "table.md").write_text("\n".join(lines) + "\n")
    (res / "table.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))
    _plot(rows, res / "table.png")


def _steady(r: dict) -> float | None:
    """The driver's steady rate (results made before the driver ranked it first included)."""
    return r.get("steady_driver") or r.get("steady_tokens_per_s")


def _failed(r: dict) -> str | None:
    if not r:
        return "not run"
    if r.get("skipped"):
        return "skipped"
    if r.get("failed") is not None or any(x != 0 for x in r.get("rc", [0])):
        return "failed"
    return None


def _ratio(a, b):
    return a / b if a and b else None


def _fmt(x, why=None) -> str:
    if x is None:
        return why or "-"
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _fr(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(9, 3.8))
    labels = [f"{r['shape']} {r['storage']}" for r in rows]
    series = [("cli", "datagen extract (defaults)"), ("deploy", "extract/kimi spec"), ("plain", "plain vLLM prefill"),
              ("disk", "disk bound (dd direct)")]
    w = 0.2
    for i, (k, label) in enumerate(series):
        ax.bar([j + (i - 1.5) * w for j in range(len(rows))], [r[k] or 0 for r in rows], w, label=label)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("steady tokens/s")
    ax.legend(fontsize=8)
    ax.set_title("issue 56: the product's commands against plain prefill and the disk")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    s = sub.add_parser("spec")
    s.add_argument("--deployment", default="kimi")
    s.add_argument("--path", default=str(DEPLOY_SPEC))
    for name in ("make", "run", "stage"):
        p = sub.add_parser(name)
        if name == "stage":
            p.add_argument("name")
            p.add_argument("--record", required=True)
            p.add_argument("--log", required=True)
            p.add_argument("--timeout", type=float, default=600)
        p.add_argument("--shape", choices=list(VOCAB), default="kimi")
        p.add_argument("--work", default="/tmp/gb")
        p.add_argument("--rows", type=int, default=1024)
        p.add_argument("--row-len", type=int, default=1024)
        p.add_argument("--repeats", type=int, default=2, help="timed passes of plain prefill")
        p.add_argument("--disk-mib", type=int, default=8192, help="MiB dd writes")
        p.add_argument("--trace", action="store_true", help="the product's commands write their engine's steps; "
                       "each record gets where its start went")
        if name == "run":
            p.add_argument("--out", default=os.environ.get("OUT", "."))
            p.add_argument("--stages", default="disk,cli-fp8,plain,cli-bf16,deploy")
            p.add_argument("--budget", type=float, default=540)
    r = sub.add_parser("report")
    r.add_argument("--results", required=True)
    args = ap.parse_args()
    {"spec": make_spec, "make": make, "run": run_all, "stage": stage, "report": report}[args.what](args)


if __name__ == "__main__":
    main()
