"""The table and the plots, from the figures' JSON records.

    python -m bench.report [--results DIR]

Writes ``<results>/table.md``, ``<results>/summary.json`` and one PNG per figure next to them,
and prints the table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench._common import RESULTS, median

ORDER = ("overhead", "engines", "cached_rerun", "validation", "publish", "memory", "reader", "planning", "train_proof")


def load(results: Path) -> list[dict]:
    recs = []
    for name in ORDER:
        p = results / f"{name}.json"
        if p.exists():
            recs.append(json.loads(p.read_text()))
    return recs


def _fmt(value: float, unit: str) -> str:
    if unit == "x":
        return f"{value:.3g}x" if value < 10 else f"{value:.0f}x"
    if unit == "%":
        return f"{value:.0f}%"
    if unit in ("tok/s", "MiB", "MB/s", "samples/s", "tok/s per core"):
        return f"{value:,.0f} {unit}"
    return f"{value:g} {unit}"


def table(recs: list[dict]) -> str:
    lines = ["| # | figure | case | median | target | met | numbers |", "|---|---|---|---|---|---|---|"]
    for rec in recs:
        for r in rec["rows"]:
            met = "" if r["met"] is None else ("yes" if r["met"] else "**no**")
            lines.append(f"| {rec['figure']} | {rec['name']} | {r['case']} | {_fmt(r['value'], r['unit'])} | "
                         f"{r['target'] or ''} | {met} | {r['detail']} |")
    return "\n".join(lines) + "\n"


# --- plots -----------------------------------------------------------------------------------

def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_overhead(rec: dict, out: Path) -> None:
    plt = _plt()
    labels, rates = [], {"plain": [], "datagen": [], "naive": []}
    ratios = {"datagen / plain": [], "datagen / plain, CPU time": [], "naive / plain": []}
    for m in rec["data"]["models"]:
        for res in m["cases"].values():
            c = res["case"]
            tokens = c["rows"] * c["row_len"]
            labels.append(f"{m['model']}\n{c['row_len']} tok")
            med = {v: median(res[v]["wall"]) for v in rates}
            for v in rates:
                rates[v].append(tokens / med[v])
            cpu = {v: median(res[v]["cpu"]) for v in rates}
            ratios["datagen / plain"].append(med["datagen"] / med["plain"])
            ratios["datagen / plain, CPU time"].append(cpu["datagen"] / cpu["plain"])
            ratios["naive / plain"].append(med["naive"] / med["plain"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(labels))
    for i, (v, ys) in enumerate(rates.items()):
        a.bar([j + (i - 1) * 0.27 for j in x], ys, 0.27, label=v)
    a.set_xticks(list(x), labels)
    a.set_yscale("log")
    a.set_ylabel("tokens/s (median)")
    a.legend()
    a.set_title("throughput")
    for i, (v, ys) in enumerate(ratios.items()):
        b.bar([j + (i - 1) * 0.27 for j in x], ys, 0.27, label=v, hatch="//" if "CPU" in v else None)
    b.axhline(1.05, color="red", linestyle="--", label="target 1.05")
    b.axhline(1.0, color="gray", linewidth=0.8)
    b.set_xticks(list(x), labels)
    b.set_ylabel("time / plain prefill time")
    b.legend()
    b.set_title("overhead (ratio of medians; wall time unless marked)")
    fig.suptitle(rec["title"])
    fig.tight_layout()
    fig.savefig(out / "fig1_overhead.png", dpi=110)
    plt.close(fig)


def plot_engines(rec: dict, out: Path) -> None:
    plt = _plt()
    labels, vllm, hf = [], [], []
    for m in rec["data"]["models"]:
        for res in m["cases"].values():
            c = res["case"]
            tokens = c["rows"] * c["row_len"]
            labels.append(f"{m['model']}\n{c['row_len']} tok")
            vllm.append(tokens / median(res["datagen"]["wall"]))
            hf.append(c["hf_rows"] * c["row_len"] / median(res["hf"]["wall"]))
    fig, a = plt.subplots(figsize=(7, 4))
    x = list(range(len(labels)))
    a.bar([j - 0.2 for j in x], vllm, 0.4, label="vLLM engine (datagen extract)")
    a.bar([j + 0.2 for j in x], hf, 0.4, label="HF reference engine")
    for j in x:
        a.text(j, vllm[j], f"{vllm[j] / hf[j]:.1f}x", ha="center", va="bottom")
    a.set_xticks(x, labels)
    a.set_yscale("log")
    a.set_ylabel("tokens/s (median)")
    a.legend()
    a.set_title(rec["title"])
    fig.tight_layout()
    fig.savefig(out / "fig2_engines.png", dpi=110)
    plt.close(fig)


def plot_cached_rerun(rec: dict, out: Path) -> None:
    plt = _plt()
    d = rec["data"]
    names = ["first run"] + [f"re-run {i + 1}" for i in range(len(d["reruns_s"]))] + ["import flows.extract"]
    vals = [d["first_run_s"], *d["reruns_s"], min(d["import_s"])]
    fig, a = plt.subplots(figsize=(7, 4))
    a.bar(names, vals, color=["gray"] + ["C0"] * len(d["reruns_s"]) + ["C2"])
    a.axhline(30, color="red", linestyle="--", label="target 30 s")
    a.set_ylabel("wall seconds")
    a.legend()
    a.set_title(rec["title"])
    fig.tight_layout()
    fig.savefig(out / "fig3_cached_rerun.png", dpi=110)
    plt.close(fig)


def plot_validation(rec: dict, out: Path) -> None:
    plt = _plt()
    g = rec["data"]["gb_per_s"]
    kinds = ["read", "sha256", "validate"]
    fig, a = plt.subplots(figsize=(7, 4))
    for i, cache in enumerate(("cold", "warm")):
        a.bar([j + (i - 0.5) * 0.4 for j in range(3)], [g[cache][k] for k in kinds], 0.4, label=f"{cache} cache")
    a.set_xticks(range(3), ["plain sequential read", "sha256 only", "datagen validate"])
    a.set_ylabel("GB/s (median)")
    a.legend()
    a.set_title(rec["title"])
    fig.tight_layout()
    fig.savefig(out / "fig4_validation.png", dpi=110)
    plt.close(fig)


def plot_publish(rec: dict, out: Path) -> None:
    plt = _plt()
    m = rec["data"]["mb_per_s"]
    names = list(m)
    fig, a = plt.subplots(figsize=(7, 4))
    a.bar(names, [m[n]["median"] for n in names])
    a.axhline(0.7 * m["boto3-one-file"]["median"], color="red", linestyle="--", label="70% of one boto3 upload")
    a.set_ylabel("MB/s (median)")
    a.legend()
    a.set_title(rec["title"])
    fig.tight_layout()
    fig.savefig(out / "fig5_publish.png", dpi=110)
    plt.close(fig)


def plot_memory(rec: dict, out: Path) -> None:
    plt = _plt()
    runs = rec["data"]["runs"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for scale, r in runs.items():
        a.plot([t for t, _ in r["samples"]], [x / 2**20 for _, x in r["samples"]], label=f"{scale}x ({r['tokens']:,} tokens)")
    a.set_xlabel("seconds since start")
    a.set_ylabel("RSS of the process tree (MiB)")
    a.legend()
    a.set_title("RSS over time")
    scales = list(runs)
    b.bar([f"{s}x" for s in scales], [runs[s]["peak_bytes"] / 2**20 for s in scales], label="peak RSS")
    b.bar([f"{s}x" for s in scales], [runs[s]["shard_bytes"] / 2**20 for s in scales], 0.3, label="shards written")
    b.set_ylabel("MiB")
    b.legend()
    b.set_title("peak RSS vs bytes written")
    fig.suptitle(rec["title"])
    fig.tight_layout()
    fig.savefig(out / "fig6_memory.png", dpi=110)
    plt.close(fig)


def plot_reader(rec: dict, out: Path) -> None:
    plt = _plt()
    rows = [r for r in rec["rows"] if r["unit"] == "samples/s"]
    first = [r for r in rec["rows"] if r["unit"] == "s"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    colors = ["gray" if "plain" in r["case"] else "C1" if "export" in r["case"] else "C0" for r in rows]
    a.barh([r["case"] for r in rows], [r["value"] for r in rows], color=colors)
    a.set_xscale("log")
    a.invert_yaxis()
    a.set_xlabel("samples/s (median; gray: plain read of the same bytes, orange: per-sample files)")
    a.tick_params(axis="y", labelsize=8)
    a.set_title(f"throughput, {rec['data']['samples']:,} samples")
    b.barh([r["case"].split(": ", 1)[-1] for r in first], [r["value"] for r in first],
           color=["C1" if "export" in r["case"] else "C0" for r in first])
    b.invert_yaxis()
    b.set_xlabel("seconds (median)")
    b.tick_params(axis="y", labelsize=8)
    b.set_title(f"time to the first batch of {rec['data']['batch']}")
    fig.suptitle(rec["title"])
    fig.tight_layout()
    fig.savefig(out / "fig7_reader.png", dpi=110)
    plt.close(fig)


def plot_planning(rec: dict, out: Path) -> None:
    from bench.planning import plot

    plot(rec, out)


def plot_train_proof(rec: dict, out: Path) -> None:
    from bench.train_proof import plot_record  # the figure draws its own plot from its record

    plot_record(rec, out)


PLOTS = {"overhead": plot_overhead, "engines": plot_engines, "cached_rerun": plot_cached_rerun,
         "validation": plot_validation, "publish": plot_publish, "memory": plot_memory, "reader": plot_reader,
         "planning": plot_planning, "train_proof": plot_train_proof}


def build(results: Path, *, failed: dict[str, str] | None = None) -> str:
    recs = load(results)
    text = table(recs)
    if failed:
        text += "\n" + "\n".join(f"- {name}: FAILED ({why})" for name, why in failed.items()) + "\n"
    (results / "table.md").write_text(text)
    for rec in recs:
        try:
            PLOTS[rec["name"]](rec, results)
        except (KeyError, ValueError, TypeError) as e:  # a record of an older layout: the table still stands
            text += f"\n- plot of {rec['name']} failed: {type(e).__name__}: {e}\n"
    summary = {"rows": [{"figure": r["figure"], "name": r["name"], **row} for r in recs for row in r["rows"]],
               "seconds": {r["name"]: r["seconds"] for r in recs}, "failed": failed or {},
               "machine": recs[0]["machine"] if recs else None}
    (results / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(RESULTS))
    args = ap.parse_args(argv)
    print(build(Path(args.results)), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
