"""Issue 40 on the GPU: the capture on Model Runner V2 and through vLLM's public API, in one command.

    python3 bench/gpu/v2.py make --work /tmp/v2w                    # the random 8B Llama (no vLLM needed)
    python3 bench/gpu/v2.py --out $OUT --work /tmp/v2w              # every stage, 8B shape, compiled
    python3 bench/gpu/v2.py --out $OUT --work /tmp/v2k --shape kimi # Kimi-K2.5's width (built on the GPU)
    python3 bench/gpu/v2.py --out /tmp/v2s --smoke                  # tiny Llama on any machine (CPU engine)

Each stage runs in a process of its own under a per-stage timeout; a failure is recorded with its
error tail and the rest still run. ``v2.json`` (every stage so far, rewritten after each), ``v2.md``
(the table) and ``v2.png`` (tokens/s per stage) go to --out. Stages, in priority order (a stage
that would not fit in --budget is skipped; ``--merge --skip-done`` in a later call runs the rest
into the same --work):

  env          what env-check says of the path and runner for each setting below (capture_paths.describe,
               the public path's self-test, V2's reader self-test, the patches' self-tests)
  v2 bf16      the internal capture on Model Runner V2 (DATAGEN_CAPTURE_RUNNER_V2=1,
               VLLM_USE_V2_MODEL_RUNNER=1): one started engine does plain passes with the capture
               paused ("prefill, same engine") and then the `datagen extract` shard loop
               (timing.extraction); its last pass is kept for the agreement
  v1 bf16      the same on the V1 runner (VLLM_USE_V2_MODEL_RUNNER=0, the pin)
  public bf16  vLLM's extract_hidden_states + the project's connector (DATAGEN_CAPTURE_PATH=public,
               VLLM_USE_V2_MODEL_RUNNER unset: 0.24.0's V2 refuses the method)
  agree        every kept run against v1 bf16: bitwise per layer, per-layer relative error; where not
               bitwise equal (and a reference loads: not at Kimi width), each run against a float32
               transformers reference on --ref-rows rows, with the neighbouring layers rejected
               (datagen.validation.compare.judge_layer)
  disk         dd oflag=direct and the shard writer's direct write (the disk bound)
  plain v2     plain vLLM prefill (no capture extension) on V2 (timing.plain_prefill)
  v2 fp8, v1 fp8, public fp8, plain v1   the same at fp8 storage, and plain on V1 (at Kimi's width bf16
               writes at the disk's rate, so the public path's cost against the internal captures
               shows in fp8)

Passes of the default 256 rows pay a run's fixed costs (the last step's writes, the groups' drains)
inside every timed pass: 0.948 at Kimi's width in fp8 against 0.966 with ``--rows 1024``. Time the
goal's ratio with long passes (``--rows 1024`` at Kimi's width in fp8, 30 GB a pass; ``--rows 768`` at
8B in bf16, 25 GB a pass: each pass's shards stay on disk until the next starts).

The ratios: V2 capture / min(plain V2 prefill, disk / bytes per token) (plain from the plain v2
stage, else the V2 engine's paused passes, labelled), and public / internal (V1 and V2).
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

from bench.gpu.storage import ENGINE, LAYERS_8B, LAYERS_KIMI, KIMI_VOCAB, _dd_rate, _plan, _rows, _write_rows  # noqa: E402

# the environment of each capture setting (applied over the caller's: the README's V sets VLLM_USE_V2_MODEL_RUNNER=0)
V1 = {"VLLM_USE_V2_MODEL_RUNNER": "0", "DATAGEN_CAPTURE_PATH": "internal", "DATAGEN_CAPTURE_RUNNER_V2": "0"}
V2 = {"VLLM_USE_V2_MODEL_RUNNER": "1", "DATAGEN_CAPTURE_PATH": "internal", "DATAGEN_CAPTURE_RUNNER_V2": "1"}
PUBLIC = {"VLLM_USE_V2_MODEL_RUNNER": None, "DATAGEN_CAPTURE_PATH": "public", "DATAGEN_CAPTURE_RUNNER_V2": "0"}
SETTINGS = {"v1": V1, "v2": V2, "public": PUBLIC}

# label -> (stage function, its setting, storage dtype, expected seconds on the H200 at 8B, compiled),
# in priority order: the goal's rows first (V2's capture and its paused passes, V1 to agree with,
# the disk bound), then the public path, then what a second call can add
STAGES = {
    "env": ("env", None, None, 0),  # beside the others (no GPU)
    "v2 bf16": ("capture", "v2", "bfloat16", 140),
    "v1 bf16": ("capture", "v1", "bfloat16", 140),
    "agree": ("agree", None, None, 60),
    "disk": ("disk", None, None, 15),
    "public bf16": ("capture", "public", "bfloat16", 125),
    "agree public": ("agree", None, None, 60),
    "plain v2": ("plain", "v2", None, 110),
    "v2 fp8": ("capture", "v2", "fp8_e4m3", 140),
    "v1 fp8": ("capture", "v1", "fp8_e4m3", 140),
    "public fp8": ("capture", "public", "fp8_e4m3", 125),
    "plain v1": ("plain", "v1", None, 110),
}
# the kept runs each agreement stage holds against v1 bf16
AGREE = {"agree": ("v2 bf16", "v2 fp8"), "agree public": ("public bf16",)}
ORDER = list(STAGES)
KIMI_SLOWER = 1.6  # Kimi-width engines start slower (storage.plan_stages)


def _cfg(work: Path) -> dict:
    return json.loads((work / "config.json").read_text())


def _env(setting: str | None) -> dict:
    env = dict(os.environ)
    for k, v in (SETTINGS.get(setting) or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def _apply(setting: str | None) -> None:
    """This process's environment for the setting (the stage processes)."""
    env = _env(setting)
    os.environ.clear()
    os.environ.update(env)


def _keep_dir(work: Path, label: str) -> Path:
    return work / "keep" / label.replace(" ", "-")


# --- stages (each in a process of its own: `v2.py stage LABEL --work W`) --------------------------

def stage_env(work: Path, label: str) -> dict:
    """What env-check reports of the path and runner, per setting, and the self-tests it runs."""
    out = {}
    for name in SETTINGS:
        cmd = [sys.executable, "-c", (
            "import json\n"
            "from datagen.engines import capture_paths, patches\n"
            "from datagen.engines.vllm_attention import is_cpu_build\n"
            "v = patches.installed_vllm_version()\n"
            "r = {'vllm': v, **capture_paths.describe(v, cpu_build=is_cpu_build())}\n"
            "def t(f):\n"
            "    try:\n"
            "        f(); return 'ok'\n"
            "    except Exception as e:\n"
            "        return f'failed: {type(e).__name__}: {e}'\n"
            "r['public_self_test'] = t(capture_paths.public_path_self_test)\n"
            "from datagen.engines.capture_v2 import v2_self_test\n"
            "r['v2_reader_self_test'] = t(v2_self_test)\n"
            "r['patch_self_tests'] = patches.run_self_tests()\n"
            "print('ENV ' + json.dumps(r, default=str))\n")]
        proc = subprocess.run(cmd, env=_env(name), capture_output=True, text=True, cwd=REPO, timeout=300)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ENV ")), None)
        out[name] = json.loads(line[4:]) if line else {"rc": proc.returncode, "error": proc.stderr[-2000:]}
    return out


def _prompts(cfg: dict):
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=r.tolist()) for r in _rows(cfg["rows"], cfg["row_len"], cfg["vocab"])]


def stage_plain(work: Path, label: str) -> dict:
    """Plain vLLM prefill (no capture extension) with the setting's runner: timing.plain_prefill."""
    from bench.gpu.timing import plain_prefill
    from datagen.extraction.run import make_engine

    cfg = _cfg(work)
    p = _plan(cfg, work / "runs" / "plain")
    rates, start = plain_prefill(make_engine(p), _prompts(cfg), tokens=cfg["rows"] * cfg["row_len"],
                                 repeats=cfg["passes"], warmup=cfg["per_shard"], until="synced")
    return {"tokens_per_s": rates, "engine_start_s": start}


def stage_capture(work: Path, label: str) -> dict:
    """One started engine of the setting: plain passes with the capture paused (internal paths),
    then the shard loop of `datagen extract` (timing.extraction), the last pass kept."""
    from bench.gpu.timing import extraction
    from datagen.extraction.run import make_engine

    cfg = _cfg(work)
    _, setting, storage, _ = STAGES[label]
    runs = work / "runs" / label.replace(" ", "-")
    shutil.rmtree(runs, ignore_errors=True)
    keep = _keep_dir(work, label)
    shutil.rmtree(keep, ignore_errors=True)
    keep.parent.mkdir(parents=True, exist_ok=True)
    group = cfg["group"]
    warm = _plan(cfg, runs / "warm", storage, group=group)
    res: dict = {"storage": storage, "setting": setting, "plan_engine": dict(warm.engine_desc)}
    eng = make_engine(warm)
    t0 = time.time()
    eng.start()
    res["engine_start_s"] = time.time() - t0
    res["engine"] = eng.describe()
    res["model_runner_classes"] = list(eng.model_runner_ran)
    tokens = cfg["rows"] * cfg["row_len"]
    if setting != "public":  # the capture paused: the same engine's prefill (aux states returned, not read)
        from vllm import SamplingParams

        prompts = _prompts(cfg)
        sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        if all(eng.llm.collective_rpc("datagen_capture_pause", args=(True,))):
            eng.llm.generate(prompts[:cfg["per_shard"]], sp, use_tqdm=False)
            rates = []
            for _ in range(cfg["passes"]):
                t1 = time.time()
                eng.llm.generate(prompts, sp, use_tqdm=False)
                rates.append(tokens / (time.time() - t1))
            eng.llm.collective_rpc("datagen_capture_pause", args=(False,))
            res["paused"] = {"tokens_per_s": rates}

    def plans():
        for i in range(cfg["passes"]):
            out = runs / f"pass{i}"
            yield _plan(cfg, out, storage, group=group)
            if i < cfg["passes"] - 1:
                shutil.rmtree(out, ignore_errors=True)  # after the pass, before the next plan (untimed)
            else:
                out.rename(keep)

    rates, written = extraction(eng, warm, plans(), tokens=tokens)
    eng.close()
    res["tokens_per_s"], res["bytes_per_s"] = rates, written
    m = json.loads((keep / "manifest.json").read_text())
    res["manifest_engine"] = m["spec"].get("engine")
    res["bytes"] = sum(s.get("bytes", 0) for s in m["shards"])
    for s in m["shards"][cfg["keep_shards"]:]:  # the agreement reads the first few (disk room: 8.6 GB a pass at 8B)
        (keep / s["path"]).unlink(missing_ok=True)
    res["bytes_per_token"] = res["bytes"] / tokens
    res["kept"] = str(keep)
    shutil.rmtree(runs, ignore_errors=True)
    return res


def _samples(run: Path) -> dict:
    from safetensors.torch import load_file

    m = json.loads((run / "manifest.json").read_text())
    out = {}
    for s in m["shards"]:
        if not (run / s["path"]).exists():  # kept: the first few shards only
            continue
        t = load_file(str(run / s["path"]))
        off = t["sample_offsets"].tolist()
        for i in range(len(off) - 1):
            out[int(t["sample_index"][i])] = (t["input_ids"][off[i]:off[i + 1]], t["hidden_states"][off[i]:off[i + 1]])
    return out


def _stats(e) -> dict:
    import torch

    e = e.float()
    return {"tokens": int(e.numel()), "median": float(e.median()), "p99": float(torch.quantile(e, 0.99)),
            "max": float(e.max())}


def stage_agree(work: Path, label: str) -> dict:
    """Every kept run against v1 bf16 (bitwise and relative error per layer); where some layer is not
    bitwise equal, each run and v1 against a float32 reference on a few rows, neighbours rejected."""
    import torch

    from datagen.validation.compare import judge_layer, neighbour_ids, token_rel_err

    cfg = _cfg(work)
    base_dir = _keep_dir(work, "v1 bf16")
    if not (base_dir / "manifest.json").exists():
        raise RuntimeError("no kept v1 bf16 run to compare against")
    others = {lab: _keep_dir(work, lab) for lab in AGREE[label] if (_keep_dir(work, lab) / "manifest.json").exists()}
    if not others:
        raise RuntimeError(f"no kept run of {' or '.join(AGREE[label])} (its stage failed or was skipped)")
    layers = list(cfg["layers"])
    base = _samples(base_dir)
    res: dict = {"against": "v1 bf16", "pairs": {}}
    loaded = {"v1 bf16": base}
    need_ref = []
    for lab, d in others.items():
        got = loaded[lab] = _samples(d)
        if set(got) != set(base):
            res["pairs"][lab] = {"error": f"rows differ: {len(got)} vs {len(base)}"}
            continue
        per = {}
        for c, k in enumerate(layers):
            equal = sum(bool(torch.equal(got[r][1][:, c], base[r][1][:, c])) for r in base)
            e = torch.cat([token_rel_err(got[r][1][:, c], base[r][1][:, c]) for r in base])
            per[str(k)] = {"bitwise_equal_rows": equal, "rows": len(base), **_stats(e)}
            # the other stored layers of the base run: how far a wrong layer would be (a pair within bf16
            # noise of each other must be far closer to the right layer than to any other)
            wrong = {str(j): float(torch.cat([token_rel_err(got[r][1][:, c], base[r][1][:, cj]) for r in base]).median())
                     for cj, j in enumerate(layers) if cj != c}
            if wrong:
                per[str(k)]["nearest_wrong_layer"] = min(wrong, key=wrong.get)
                per[str(k)]["nearest_wrong_median"] = min(wrong.values())
        res["pairs"][lab] = {"layers": per, "bitwise_identical": all(v["bitwise_equal_rows"] == v["rows"]
                                                                     for v in per.values())}
        if not res["pairs"][lab]["bitwise_identical"]:
            need_ref.append(lab)
    if need_ref and cfg["shape"] != "kimi":
        from datagen.engines.hf import HFReference

        n = cfg["num_hidden_layers"]
        t0 = time.time()
        ref = HFReference(cfg["model"], layer_ids=tuple(range(n + 1)), num_hidden_layers=n, dtype="float32")
        res["reference_load_s"] = time.time() - t0
        rows = sorted(base)[:cfg["ref_rows"]]
        want = {}
        for r in rows:
            ids = base[r][0].tolist()
            byid = ref.states_by_id(ids, tuple(range(n + 1)))
            want[r] = byid
        res["reference"] = {"dtype": "float32", "rows": rows, "runs": {}}
        for lab in ["v1 bf16", *need_ref]:
            got = loaded[lab]
            verdicts = {}
            for c, k in enumerate(layers):
                stored = torch.cat([got[r][1][:, c] for r in rows]).float()
                right = torch.cat([want[r][k] for r in rows]).float()
                neigh = {f"layer {j}": torch.cat([want[r][j] for r in rows]).float() for j in neighbour_ids(k, n)}
                v = judge_layer(stored, right, neigh, layer_id=k)
                e = token_rel_err(stored, right)
                verdicts[str(k)] = {**v.to_json(), "p99": float(torch.quantile(e.float(), 0.99)),
                                    "problems": list(v.problems)}
            res["reference"]["runs"][lab] = verdicts
    elif need_ref:
        res["reference"] = {"skipped": "no float32 reference at Kimi width (INT4 experts): the pair statistics only"}
    return res


def stage_disk(work: Path, label: str) -> dict:
    """The volume's direct-write speed: dd oflag=direct, then the shard writer's own write."""
    from datagen.data.shards.writer import _Buffer, write_image

    cfg = _cfg(work)
    d = work / "disk"
    d.mkdir(parents=True, exist_ok=True)
    mb = 16 if cfg["shape"] == "tiny" else 4096
    target = d / "ddtest"
    proc = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={mb // 16}", "oflag=direct"],
                          capture_output=True, text=True)
    target.unlink(missing_ok=True)
    line = (proc.stderr.strip().splitlines() or ["?"])[-1]
    size = (16 if cfg["shape"] == "tiny" else 1024) << 20
    buf = _Buffer.get(size)
    buf[:size] = os.urandom(1 << 20) * (size >> 20)
    rates, direct = [], None
    for i in range(3):
        t0 = time.time()
        _, direct = write_image(d / f"w{i}", buf, size)
        rates.append(size / (time.time() - t0))
        (d / f"w{i}").unlink()
    shutil.rmtree(d, ignore_errors=True)
    return {"dd": line, "dd_bytes_per_s": _dd_rate(line), "writer_bytes_per_s": statistics.median(rates),
            "writer_direct": direct}


FUNCS = {"env": stage_env, "plain": stage_plain, "capture": stage_capture, "agree": stage_agree, "disk": stage_disk}


def run_stage(label: str, work: Path, record: Path) -> None:
    kind, setting, _, _ = STAGES[label]
    _apply(setting)
    rec = FUNCS[kind](work, label)
    record.write_text(json.dumps(rec, default=str))


# --- the driver -------------------------------------------------------------------------------

def _med(x):
    return statistics.median(x) if x else None


def ratios(st: dict) -> dict:
    ok = {k: v for k, v in st.items() if v.get("status") == "ok"}
    out: dict = {}
    disk = (ok.get("disk") or {}).get("dd_bytes_per_s")
    for cap, plain_lab in (("v2 bf16", "plain v2"), ("v2 fp8", "plain v2"), ("v1 bf16", "plain v1"),
                           ("v1 fp8", "plain v1")):
        r = ok.get(cap)
        if not r:
            continue
        tps = _med(r["tokens_per_s"])
        plain, src = _med((ok.get(plain_lab) or {}).get("tokens_per_s")), plain_lab
        if plain is None:
            plain, src = _med((r.get("paused") or {}).get("tokens_per_s")), f"{cap}, capture paused (same engine)"
        bound = [x for x in (plain, disk / r["bytes_per_token"] if disk and r.get("bytes_per_token") else None)
                 if x]
        if bound:
            b = min(bound)
            out[f"{cap} / min(plain, disk)"] = {"ratio": tps / b, "capture": tps, "plain": plain, "plain_from": src,
                                                "disk_bound": disk / r["bytes_per_token"] if disk else None,
                                                "goal_0.95_met": tps >= 0.95 * b}
    for storage in ("bf16", "fp8"):
        pub = ok.get(f"public {storage}")
        for internal in (f"v1 {storage}", f"v2 {storage}"):
            if pub and ok.get(internal):
                out[f"public {storage} / {internal}"] = {
                    "ratio": _med(pub["tokens_per_s"]) / _med(ok[internal]["tokens_per_s"])}
    return out


def _reason(r: dict) -> str:
    """A failed or skipped stage's reason in one line: the last line naming an error, else the last."""
    lines = [ln.strip() for ln in (r.get("error") or r.get("why") or "").strip().splitlines() if ln.strip()]
    named = [ln for ln in lines if ("rror" in ln or ln.startswith("timed out")) and not ln.startswith("For further")]
    return ((named or lines or [""])[-1])[:240].replace("|", "/")


def _render_agree(label: str, a: dict | None) -> list[str]:
    lines: list[str] = []
    if a and a.get("status") == "ok":
        lines += ["", "| pair (against v1 bf16) | layer | rows bitwise equal | median rel | p99 rel | max rel | "
                  "nearest wrong stored layer (median) |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for pair, p in a["pairs"].items():
            for k, s in (p.get("layers") or {}).items():
                wrong = (f"{s['nearest_wrong_layer']} ({s['nearest_wrong_median']:.1%})"
                         if "nearest_wrong_layer" in s else "")
                lines.append(f"| {pair} | {k} | {s['bitwise_equal_rows']}/{s['rows']} | {s['median']:.3%} | "
                             f"{s['p99']:.3%} | {s['max']:.3%} | {wrong} |")
        ref = a.get("reference") or {}
        if ref.get("runs"):
            lines += ["", f"float32 reference, rows {ref['rows']}:", "",
                      "| run | layer | median | p90 | p99 | nearest neighbour (median) | ok |", "| --- | --- | --- | --- | --- | --- | --- |"]
            for run, per in ref["runs"].items():
                for k, v in per.items():
                    nm = v.get("neighbour_median")
                    lines.append(f"| {run} | {k} | {v['median']:.3%} | {v['high']:.3%} | {v['p99']:.3%} | "
                                 f"{v.get('neighbour')} ({nm:.1%}) | {v['ok']} |" if nm is not None else
                                 f"| {run} | {k} | {v['median']:.3%} | {v['high']:.3%} | {v['p99']:.3%} | - | {v['ok']} |")
        elif ref.get("skipped"):
            lines += ["", ref["skipped"]]
    elif a:
        lines += ["", f"{label}: {a.get('status')}: {_reason(a)}"]
    return lines


def render(results: dict) -> str:
    cfg = results["config"]
    st = results["stages"]
    lines = [f"device: {results['device']}; vLLM {results.get('vllm')}; shape {cfg['shape']}; {cfg['rows']} rows x "
             f"{cfg['row_len']} tokens, layers {cfg['layers']}, {cfg['per_shard']} rows/shard, shard_group "
             f"{cfg['group']}, median of {cfg['passes']} passes, {'eager' if cfg['eager'] else 'compiled'}", "",
             "| stage | status | tokens/s | paused (same engine) tokens/s | GB/s written | bytes/token | engine start s "
             "| runner (ran) | manifest capture_path / model_runner |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for lab in ORDER:
        r = st.get(lab)
        if r is None or STAGES[lab][0] in ("env", "agree", "disk"):
            continue
        if r.get("status") != "ok":
            lines.append(f"| {lab} | {r.get('status')} | {_reason(r)} | | | | | | |")
            continue
        me = r.get("manifest_engine") or {}
        lines.append("| {} | ok | {} | {} | {} | {} | {} | {} | {} |".format(
            lab, f"{_med(r['tokens_per_s']):,.0f}",
            f"{_med(r['paused']['tokens_per_s']):,.0f}" if r.get("paused") else "",
            f"{_med(r['bytes_per_s']) / 1e9:.2f}" if r.get("bytes_per_s") else "",
            f"{r['bytes_per_token']:,.0f}" if r.get("bytes_per_token") else "",
            f"{r.get('engine_start_s', 0):.0f}",
            (r.get("engine") or {}).get("model_runner") or "",
            f"{me.get('capture_path', '')} / {me.get('model_runner', '')}" if me else ""))
    d = st.get("disk")
    if d and d.get("status") == "ok":
        lines += ["", f"disk: dd oflag=direct {d['dd']!r}; shard writer {d['writer_bytes_per_s'] / 1e9:.2f} GB/s "
                  f"({'O_DIRECT' if d.get('writer_direct') else 'buffered'})"]
    rt = ratios(st)
    if rt:
        lines += ["", "| ratio | value | detail |", "| --- | --- | --- |"]
        for k, v in rt.items():
            detail = {x: (round(y) if isinstance(y, float) else y) for x, y in v.items() if x != "ratio"}
            lines.append(f"| {k} | {v['ratio']:.3f} | {json.dumps(detail)} |")
    for alab in AGREE:
        lines += _render_agree(alab, st.get(alab))
    e = st.get("env")
    if e and e.get("status") == "ok":
        lines += ["", "| setting | env-check: capture_path / model_runner | public self-test | V2 reader self-test | why |",
                  "| --- | --- | --- | --- | --- |"]
        for name, r in e.items():
            if isinstance(r, dict) and name in SETTINGS:
                lines.append(f"| {name} | {r.get('capture_path')} / {r.get('model_runner')} | "
                             f"{str(r.get('public_self_test'))[:80]} | {str(r.get('v2_reader_self_test'))[:80]} | "
                             f"{str(r.get('why') or r.get('error'))[:200]} |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    bars = []
    for lab in ORDER:
        r = results["stages"].get(lab) or {}
        if r.get("status") == "ok" and r.get("tokens_per_s"):
            bars.append((lab, _med(r["tokens_per_s"]), "tab:blue"))
            if r.get("paused"):
                bars.append((f"{lab}, capture paused", _med(r["paused"]["tokens_per_s"]), "tab:gray"))
    if not bars:
        return
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(bars) + 1.5))
    ax.barh([b[0] for b in bars], [b[1] for b in bars], color=[b[2] for b in bars])
    d = results["stages"].get("disk") or {}
    bpt = [r.get("bytes_per_token") for r in results["stages"].values() if r.get("bytes_per_token")]
    if d.get("dd_bytes_per_s") and bpt:
        x = d["dd_bytes_per_s"] / max(bpt)
        ax.axvline(x, ls="--", color="tab:red")
        ax.text(x, -0.6, f" disk / {max(bpt):,.0f} B", color="tab:red", fontsize=8)
    ax.set_xlabel("tokens/s (median)")
    ax.invert_yaxis()
    ax.set_title(f"issue 40: V1, V2 and the public path ({results['device']}, {results['config']['shape']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def make(args) -> None:
    """The model of the shape (storage.py's builders), without vLLM."""
    from bench.gpu.storage import stage_model

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = args.model or str(work / {"tiny": "tiny", "kimi": "kimi"}.get(args.shape, "m8b"))
    (work / "config.json").write_text(json.dumps({"shape": args.shape, "model": model}))
    rec = stage_model(argparse.Namespace(work=str(work), smoke=args.shape == "tiny"))
    print(json.dumps({"model": model, **rec}), flush=True)


def _run_stage_process(cmd: list[str], env: dict, timeout: float) -> tuple[int | str, str]:
    """The stage's process in a session of its own: on a timeout the whole group goes (vLLM's
    engine-core process too, which would hold the GPU's memory from the next stage)."""
    import signal

    with open(os.devnull, "rb") as devnull:
        proc = subprocess.Popen(cmd, env=env, stdin=devnull, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=REPO, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _, err = proc.communicate()
            rc, err = "timeout", f"timed out after {timeout:.0f} s\n" + (err or "")
    try:  # whatever the stage left behind in its group (an engine core outliving its driver)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return rc, err or ""


def run_all(args) -> None:
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    tiny, kimi = args.shape == "tiny", args.shape == "kimi"
    model = args.model or str(work / ("tiny" if tiny else "kimi" if kimi else "m8b"))
    data = work / "rows.jsonl"
    vocab = 500 if tiny else KIMI_VOCAB if kimi else 128256
    _write_rows(data, _rows(args.rows, args.row_len, vocab))
    layers = [2, 3, 6] if tiny else list(LAYERS_KIMI if kimi else LAYERS_8B)
    n_layers = 6 if tiny else 8 if kimi else 32
    per_shard = args.per_shard
    cfg = {"shape": args.shape, "model": model, "data": str(data), "rows": args.rows, "row_len": args.row_len,
           "vocab": vocab, "per_shard": per_shard, "group": max(1, args.rows // per_shard // 2), "passes": args.passes,
           "layers": layers, "num_hidden_layers": n_layers, "ref_rows": args.ref_rows, "keep_shards": 2, "eager": bool(args.eager),
           "hidden": 64 if tiny else 7168 if kimi else 4096, "hf_shards": 1, "out_dir": str(work / "runs")}
    (work / "config.json").write_text(json.dumps(cfg))
    if not Path(model, "config.json").exists():
        from bench.gpu.storage import stage_model

        print(f"building the {args.shape} model at {model}", flush=True)
        stage_model(argparse.Namespace(work=str(work), smoke=tiny))
    try:
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001
        device = "cpu"
    try:
        from datagen.engines.patches import installed_vllm_version

        vllm_version = installed_vllm_version()
    except Exception:  # noqa: BLE001
        vllm_version = None
    state = work / "v2-results.json"
    results: dict = {"config": cfg, "device": device, "vllm": vllm_version, "stages": {}, "calls": []}
    if args.merge and state.exists():
        prev = json.loads(state.read_text())
        if prev["config"] != cfg:
            raise SystemExit(f"--merge: {state} was made with another configuration")
        results["stages"], results["calls"] = prev["stages"], prev.get("calls", [])
    results["calls"].append({"argv": sys.argv[1:], "stages": []})

    def save() -> None:
        results["stages"] = {k: results["stages"][k] for k in ORDER if k in results["stages"]}
        results["ratios"] = ratios(results["stages"])
        text = json.dumps(results, indent=1, default=str)
        state.write_text(text)
        (out / "v2.json").write_text(text)

    wanted = [s.strip() for s in args.stages.split(",")] if args.stages else ORDER
    unknown = [s for s in wanted if s not in STAGES]
    if unknown:
        raise SystemExit(f"--stages: unknown {unknown}; stages: {', '.join(ORDER)}")
    scale = KIMI_SLOWER if kimi else 1.0
    t_start = time.time()
    base_env = {"PYTHONUNBUFFERED": "1", "DATAGEN_ENFORCE_EAGER": "1" if args.eager else "0"}
    background = None  # the env stage needs no GPU: it runs beside the others
    if "env" in wanted and not (args.skip_done and results["stages"].get("env", {}).get("status") == "ok"):
        rec_env = work / "stage-env.json"
        rec_env.unlink(missing_ok=True)
        background = (subprocess.Popen(
            [sys.executable, __file__, "stage", "env", "--work", str(work), "--record", str(rec_env)],
            env={**os.environ, **base_env}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=(work / "stage-env.log").open("w"), cwd=REPO, start_new_session=True), time.time(), rec_env)
    for label in [s for s in ORDER if s in wanted and s != "env"]:
        if args.skip_done and results["stages"].get(label, {}).get("status") == "ok":
            continue
        left = args.budget - (time.time() - t_start)
        expect = STAGES[label][3] * scale
        if not tiny and expect > left:
            if results["stages"].get(label, {}).get("status") != "ok":
                results["stages"][label] = {"status": "skipped", "why": f"expected {expect:.0f} s, {left:.0f} s left"}
            print(f"[{time.time() - t_start:6.1f}s] {label}: skipped ({left:.0f} s left)", flush=True)
            save()
            continue
        rec = work / f"stage-{label.replace(' ', '_')}.json"
        rec.unlink(missing_ok=True)
        timeout = args.timeout if tiny else max(30.0, min(args.timeout, left))
        cmd = [sys.executable, __file__, "stage", label, "--work", str(work), "--record", str(rec)]
        t0 = time.time()
        rc, err = _run_stage_process(cmd, {**os.environ, **base_env}, timeout)
        dt = time.time() - t0
        if rc == 0 and rec.exists():
            r = {"status": "ok", "seconds": dt, **json.loads(rec.read_text())}
        else:
            r = {"status": "failed", "seconds": dt, "exit": rc, "error": (err or "")[-6000:]}
        (work / f"stage-{label.replace(' ', '_')}.log").write_text(err or "")
        (out / "logs").mkdir(exist_ok=True)
        (out / "logs" / f"{label.replace(' ', '_')}.log").write_text((err or "")[-200_000:])
        results["stages"][label] = r
        results["calls"][-1]["stages"].append(label)
        save()
        med = _med(r.get("tokens_per_s") or [])
        print(f"[{time.time() - t_start:6.1f}s] {label}: {r['status']} in {dt:.0f} s"
              + (f", {med:,.0f} tok/s" if med else ""), flush=True)
        if r["status"] == "failed":
            print("   " + "\n   ".join(r["error"].strip().splitlines()[-8:]), flush=True)
    if background is not None:
        proc, t0, rec_env = background
        try:
            proc.wait(timeout=max(5.0, min(120.0, args.budget + 30 - (time.time() - t_start))))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        err = (work / "stage-env.log").read_text()[-6000:]
        results["stages"]["env"] = ({"status": "ok", "seconds": time.time() - t0, **json.loads(rec_env.read_text())}
                                    if proc.returncode == 0 and rec_env.exists() else
                                    {"status": "failed", "exit": proc.returncode, "error": err})
        print(f"[{time.time() - t_start:6.1f}s] env: {results['stages']['env']['status']}", flush=True)
    results["calls"][-1]["seconds"] = time.time() - t_start
    save()
    table = render(results)
    (out / "v2.md").write_text(table + "\n")
    print(table, flush=True)
    plot(results, out / "v2.png")
    shutil.rmtree(work / "runs", ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", nargs="?", choices=["run", "make", "stage"], default="run")
    ap.add_argument("label", nargs="?", help="stage: its label")
    ap.add_argument("--record")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "v2bench"))
    ap.add_argument("--model", help="model directory (default: built under --work)")
    ap.add_argument("--shape", choices=["8b", "kimi", "tiny"], default="8b")
    ap.add_argument("--smoke", action="store_true", help="= --shape tiny --eager (the CPU engine, any machine)")
    ap.add_argument("--stages", help=f"comma-separated labels (default all: {', '.join(ORDER)})")
    ap.add_argument("--rows", type=int, help="rows per pass (default 256; tiny 12)")
    ap.add_argument("--row-len", type=int, help="tokens per row (default 1024; tiny 128)")
    ap.add_argument("--per-shard", type=int, help="rows per shard (default 8; tiny 4)")
    ap.add_argument("--passes", type=int, help="timed passes per stage (default 2)")
    ap.add_argument("--ref-rows", type=int, default=2, help="rows held against the float32 reference")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per stage at most")
    ap.add_argument("--budget", type=float, default=500.0, help="seconds for all stages (a stage expected "
                    "not to fit is skipped)")
    ap.add_argument("--eager", action="store_true", help="DATAGEN_ENFORCE_EAGER=1 (default: compiled)")
    ap.add_argument("--merge", action="store_true", help="add to the stages of an earlier call with this --work")
    ap.add_argument("--skip-done", action="store_true", help="with --merge: leave out the stages already ok")
    args = ap.parse_args()
    if args.cmd == "stage":
        run_stage(args.label, Path(args.work), Path(args.record))
        return
    if args.smoke:
        args.shape, args.eager = "tiny", True
    tiny = args.shape == "tiny"
    for name, value in zip(("rows", "row_len", "per_shard", "passes"), (12, 128, 4, 2) if tiny else (256, 1024, 8, 2)):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.cmd == "make":
        make(args)
        return
    run_all(args)


if __name__ == "__main__":
    main()
