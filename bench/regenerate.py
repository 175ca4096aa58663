"""Regeneration on the CPU: the step's path against plain vLLM ``generate`` of the same prompts.

    python -m bench.regenerate [--rows 32] [--max-new-tokens 64] [--repeats 3] [--out bench/results]

The measurement of ``bench/gpu/regenerate.py`` (one engine; regenerate, plain and prefill passes
alternating, medians) with the real trained SmolLM2-135M-Instruct (``datagen.testmodels.smollm2``)
on the vLLM CPU engine (eager), greedy, on short real questions, so that turns end where the
model ends them. Writes regenerate.json, regenerate.md (the table) and regenerate.png.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path

from bench._common import ROOT, engine_env
from bench.gpu.regenerate import measure, table

TOPICS = ["the water cycle", "photosynthesis", "a binary search", "the moon's phases", "compound interest",
          "how vaccines work", "why leaves change color", "a hash table", "gravity", "the French revolution",
          "rainbows", "recursion", "volcanoes", "the stock market", "tides", "electric circuits"]
ASKS = ["Explain {} in two sentences.", "What is {}? Answer briefly."]


def questions(n: int) -> list[dict]:
    out = []
    for i in range(n):
        ask = ASKS[(i // len(TOPICS)) % len(ASKS)]
        out.append({"messages": [{"role": "user", "content": ask.format(TOPICS[i % len(TOPICS)])}]})
    return out


def one_pass_parity(model: str, rows: list[dict], *, max_new_tokens: int, layer_ids=(2, 15, 27)) -> dict:
    """Would the states a generation computes hold the parity statistics of a prefill-only extraction?

    transformers in bf16 generates each prompt greedily with its KV cache and returns, step by step,
    the states of the token fed in (the generated token of the step before): the states a capture
    during generation would store. The same tokens (prompt + generated) are then run as one
    prefill in bf16 (what the extraction computes) and in float32 (the reference). Per layer: the
    median, p90 and p99 token error of each against the reference, and the decode states against
    the reference's neighbouring layers (the off-by-one check). The last generated token has no
    decode state (it is never fed in); id N is left out (transformers' last state is after the norm).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from datagen.validation.compare import judge_layer, token_rel_err

    tok = AutoTokenizer.from_pretrained(model)
    bf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    ref = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    dec, pre, fp = ({k: [] for k in range(max(layer_ids) + 2)} for _ in range(3))
    for r in rows:
        text = tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            g = bf.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, output_hidden_states=True,
                            return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
            n = g.sequences.shape[1] - ids.shape[1]
            if n < 2:
                continue
            full = g.sequences[:, : ids.shape[1] + n - 1]  # the last token has no decode state
            hp = bf(full, output_hidden_states=True).hidden_states
            hr = ref(full, output_hidden_states=True).hidden_states
        for k in dec:
            dec[k].append(torch.cat([g.hidden_states[t][k][0, -1:] for t in range(1, n)]).float())
            pre[k].append(hp[k][0, ids.shape[1]:].float())
            fp[k].append(hr[k][0, ids.shape[1]:].float())
    cat = {name: {k: torch.cat(v) for k, v in d.items()} for name, d in (("dec", dec), ("pre", pre), ("fp", fp))}

    def stats(e):
        return {"median": float(e.median()), "p90": float(torch.quantile(e, 0.9)), "p99": float(torch.quantile(e, 0.99))}

    out = {"tokens": int(cat["fp"][layer_ids[0]].shape[0]), "layers": {}}
    for k in layer_ids:
        nb = {f"layer {j}": cat["fp"][j] for j in (k - 1, k + 1)}
        v = judge_layer(cat["dec"][k], cat["fp"][k], nb, layer_id=k)
        out["layers"][str(k)] = {
            "decode_vs_float32": stats(token_rel_err(cat["dec"][k], cat["fp"][k])),
            "prefill_vs_float32": stats(token_rel_err(cat["pre"][k], cat["fp"][k])),
            "decode_vs_prefill_bf16": stats(token_rel_err(cat["dec"][k], cat["pre"][k])),
            "decode_vs_neighbour_median": v.neighbour_median, "golden_check_passes": v.ok,
        }
    return out


def thinking_parity(model: str, rows: list[dict], *, reasoning_tokens: int = 48, answer_tokens: int = 48,
                    layer_ids=(2, 15, 27)) -> dict:
    """Would one pass hold where the template drops the reasoning of finished turns (Kimi-K2-Thinking)?

    A thinking model generates ``<think>R</think>A``: the states a capture during generation would
    store for the answer A are computed after its own reasoning R. Kimi-K2-Thinking's real template
    renders every finished assistant turn of a chat as ``<think></think>A`` (docs/datasets.md), so
    the extraction of the regenerated chat stores A's states after an empty think block. Both are
    measured on the real SmolLM2 (float32 prefills, greedy R and A): the answer's states in the
    generation's context against those of the extraction's rendering, per layer, with the golden
    check of the extraction's rendering as the reference. The answer is held to at least half its
    tokens (this small model tends to end a turn right after a think block).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from datagen.validation.compare import judge_layer, token_rel_err

    tok = AutoTokenizer.from_pretrained(model)
    ref = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = lambda t: torch.tensor([tok(t, add_special_tokens=False)["input_ids"]])  # noqa: E731
    gen = {k: [] for k in range(max(layer_ids) + 2)}
    ext = {k: [] for k in gen}
    for r in rows:
        prompt = tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True) + "<think>"
        with torch.no_grad():
            p = ids(prompt)
            reasoning = ref.generate(p, max_new_tokens=reasoning_tokens, do_sample=False,
                                     pad_token_id=tok.eos_token_id)[0, p.shape[1]:]
            head = torch.cat([p[0], reasoning, ids("</think>")[0]])[None]
            answer = ref.generate(head, max_new_tokens=answer_tokens, min_new_tokens=answer_tokens // 2,
                                  do_sample=False, pad_token_id=tok.eos_token_id)[0, head.shape[1]:]
            plain = ids(prompt + "</think>")[0]
            a = ref(torch.cat([head[0], answer])[None], output_hidden_states=True).hidden_states
            b = ref(torch.cat([plain, answer])[None], output_hidden_states=True).hidden_states
        for k in gen:
            gen[k].append(a[k][0, head.shape[1]:])
            ext[k].append(b[k][0, plain.shape[0]:])
    gen = {k: torch.cat(v) for k, v in gen.items()}
    ext = {k: torch.cat(v) for k, v in ext.items()}
    out = {"tokens": int(gen[layer_ids[0]].shape[0]), "layers": {}}
    for k in layer_ids:
        e = token_rel_err(gen[k], ext[k])
        v = judge_layer(gen[k], ext[k], {f"layer {j}": ext[j] for j in (k - 1, k + 1)}, layer_id=k)
        out["layers"][str(k)] = {"median": float(e.median()), "p99": float(torch.quantile(e, 0.99)),
                                 "neighbour_median": v.neighbour_median, "golden_check_passes": v.ok}
    return out


def thinking_table(p: dict) -> str:
    lines = [f"One pass where the template drops finished turns' reasoning: the answer's {p['tokens']} tokens "
             "after the model's own reasoning (what the generation computes) against the same tokens after "
             "an empty think block (what the extraction of the chat stores), float32", "",
             "| layer | median | p99 | the extraction's neighbour layer: median | golden check |", "|---|---|---|---|---|"]
    for k, r in p["layers"].items():
        lines.append(f"| {k} | {r['median']:.2%} | {r['p99']:.2%} | {r['neighbour_median']:.1%} | "
                     f"{'passes' if r['golden_check_passes'] else 'fails'} |")
    return "\n".join(lines)


def parity_table(p: dict) -> str:
    lines = [f"One pass: states of generated tokens as the generation computes them (transformers bf16, KV "
             f"cache) against a float32 prefill of the same {p['tokens']} tokens, next to a bf16 prefill",
             "", "| layer | decode vs fp32: median / p90 / p99 | bf16 prefill vs fp32: median / p90 / p99 | "
             "decode vs bf16 prefill: median | decode vs neighbour layer: median | golden check |",
             "|---|---|---|---|---|---|"]
    f = lambda d: f"{d['median']:.2%} / {d['p90']:.2%} / {d['p99']:.2%}"  # noqa: E731
    for k, r in p["layers"].items():
        lines.append(f"| {k} | {f(r['decode_vs_float32'])} | {f(r['prefill_vs_float32'])} | "
                     f"{r['decode_vs_prefill_bf16']['median']:.2%} | {r['decode_vs_neighbour_median']:.1%} | "
                     f"{'passes' if r['golden_check_passes'] else 'fails'} |")
    return "\n".join(lines)


def plot(rec: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    names = ["regenerate (step's path)", "plain vLLM generate"]
    vals = [rec["regenerate_tok_s"], rec["plain_tok_s"]]
    ax.barh(names, vals, color=["tab:blue", "tab:gray"])
    for y, v in enumerate(vals):
        ax.text(v, y, f" {v:.0f}", va="center")
    ax.set_xlabel("generated tokens/s (median)")
    ax.set_title(f"SmolLM2-135M on the vLLM CPU engine: ratio {rec['ratio']:.3f}; "
                 f"prefill-only pass {rec['prefill_share'] * 100:.0f}% of regeneration", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rows-per-chunk", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    engine_env()
    from datagen.testmodels import smollm2

    work = ROOT / ".cache" / "bench" / "regenerate"
    work.mkdir(parents=True, exist_ok=True)
    model = smollm2.build(ROOT / ".cache" / f"smollm2-{smollm2.version()}")
    rec = measure(str(model), questions(args.rows), max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                  rows_per_chunk=args.rows_per_chunk, work=work)
    rec["device"] = "cpu"
    rec["one_pass_parity"] = one_pass_parity(str(model), questions(8), max_new_tokens=args.max_new_tokens)
    rec["thinking_parity"] = thinking_parity(str(model), questions(8))
    rec["medians_s"] = {k: statistics.median(v) for k, v in rec["seconds"].items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "regenerate.json").write_text(json.dumps(rec, indent=1) + "\n")
    t = "\n\n".join([table(rec), parity_table(rec["one_pass_parity"]), thinking_table(rec["thinking_parity"])])
    (out / "regenerate.md").write_text(t + "\n")
    print(t)
    plot(rec, out / "regenerate.png")


if __name__ == "__main__":
    main()
