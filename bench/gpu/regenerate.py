"""Regeneration throughput against plain vLLM ``generate`` of the same prompts, one command.

    python3 bench/gpu/regenerate.py --out $OUT             # on the GPU machine (bench/gpu/README.md stages vLLM)
    python3 bench/gpu/regenerate.py --out /tmp/r --smoke   # any machine: tiny model, CPU engine, a minute

One engine, started once; the passes alternate on it, each from an empty prefix cache:

  regenerate   the step's own path (datagen.regeneration: ChunkRunner on the Generator): render each
               chat with the chat template, tokenize, generate in chunks of rows_per_chunk rows,
               decode, write the chunk files, then chats.jsonl, lineage.jsonl and the manifest
  plain        ``LLM.generate`` of the same prompt ids with the same sampling parameters, all rows in
               one call (ids rendered beforehand, nothing written): the engine's own speed
  prefill      ``LLM.generate(max_tokens=1)`` of each prompt with its generated turn: the engine time a second, prefill-only pass over the same tokens costs, i.e.
               the most that capturing the states during generation ("one pass") could save

tokens/s = generated tokens / wall seconds of the pass (median of --repeats). The random 8B Llama
shape (as bench/gpu/run.py's make_model: vocabulary 128256) is built when --model is not given,
with the project's small BPE tokenizer and chat template (datagen.models.tiny.make_tokenizer);
generated ids beyond that tokenizer decode to nothing, so the prefill pass is timed on the prompt
ids plus the generated ids (the tokens an extraction of the chat reads). Prompts are user turns of random words of
about --prompt-tokens tokens; every turn runs to --max-new-tokens (random weights rarely end a turn).
The record goes to OUT/regenerate.json and the table to OUT/regenerate.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def build_model(d: Path, *, smoke: bool) -> None:
    """A random-weight Llama with the project's tokenizer (8B shape, or tiny with --smoke)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from datagen.testmodels.tiny import make_tokenizer

    if (d / "config.json").exists():
        return
    d.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(d, vocab_size=400 if smoke else 4096)
    shape = (dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1) if smoke else
             dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8))
    cfg = LlamaConfig(vocab_size=len(tok) if smoke else 128256, max_position_embeddings=8192, rope_theta=500000.0,
                      tie_word_embeddings=False, torch_dtype="bfloat16", eos_token_id=tok.eos_token_id, **shape)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02)
    model.save_pretrained(d, safe_serialization=True)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the engine measures the free memory it may take


def prompts(n: int, words: int, seed: int = 0) -> list[dict]:
    from datagen.testmodels.tiny import _WORDS

    rng = random.Random(seed)
    return [{"messages": [{"role": "user", "content": " ".join(rng.choice(_WORDS) for _ in range(words))}]}
            for _ in range(n)]


def measure(model: str, rows: list[dict], *, max_new_tokens: int, repeats: int, rows_per_chunk: int,
            work: Path, engine: dict | None = None) -> dict:
    """Start one engine and time the three passes (module docstring); returns the raw record."""
    from transformers import AutoTokenizer

    from datagen.regeneration.generator import Generator, TurnRequest, stop_token_ids
    from datagen.regeneration.output import OutputDir
    from datagen.regeneration.rounds import ChunkRunner
    from datagen.regeneration.settings import RegenerationSettings
    from datagen.models.modelinfo import inspect_model

    info = inspect_model(model)
    tok = AutoTokenizer.from_pretrained(model)
    s = RegenerationSettings(max_new_tokens=max_new_tokens, rows_per_chunk=rows_per_chunk, **(engine or {}))
    window = min(info.max_position_embeddings or 8192, 8192)
    from datagen.engines.vllm_attention import choose_attention_backend

    gen = Generator(model, s, max_model_len=window, stop_ids=stop_token_ids(model, tok),
                    attention_backend=choose_attention_backend(info, None))
    t0 = time.monotonic()
    gen.start()
    start_s = time.monotonic() - t0
    runner = ChunkRunner(s, tok, gen, None, window)
    lines = [(i, json.dumps(r).encode(), r["messages"]) for i, r in enumerate(rows)]
    chunks = [lines[i:i + rows_per_chunk] for i in range(0, len(lines), rows_per_chunk)]
    prompt_ids = [runner.prompt_ids(r["messages"]) for r in rows]
    times: dict[str, list[float]] = {"regenerate": [], "plain": [], "prefill": []}
    tokens: dict[str, list[int]] = {"regenerate": [], "plain": []}
    prefill_tokens = 0
    try:
        for rep in range(repeats):
            # regenerate: the step's path, files included
            out = work / f"out-{rep}"
            shutil.rmtree(out, ignore_errors=True)
            t = time.monotonic()
            od = OutputDir(out, "bench")
            od.begin()
            records = list(runner.run_all([(k, part, "") for k, part in enumerate(chunks)], fp="bench",
                                          write=od.write_chunk))
            m = od.finish(records, _manifest_stub(s, len(rows), len(chunks)))
            times["regenerate"].append(time.monotonic() - t)
            tokens["regenerate"].append(sum(t["tokens"] for rec in records for e in rec.lineage for t in e["turns"]))
            # plain: the same prompt ids, the same parameters, one generate call
            gen.new_chunk()
            t = time.monotonic()
            res = gen.generate([TurnRequest(ids, max_new_tokens, None) for ids in prompt_ids])
            times["plain"].append(time.monotonic() - t)
            tokens["plain"].append(sum(len(r.token_ids) for r in res))
            # prefill: each prompt with its generated turn and the end of turn, one token sampled
            turns = {e["source_row"]: e["turns"][0]["token_ids"] for rec in records for e in rec.lineage}
            full = [prompt_ids[i] + turns[i] + gen.stop_ids[:1] for i in sorted(turns)]
            prefill_tokens = sum(len(f) for f in full)
            gen.new_chunk()
            t = time.monotonic()
            gen.generate([TurnRequest(f, 1, None) for f in full])
            times["prefill"].append(time.monotonic() - t)
            if rep == 0:  # not timed: do the generated ids come back when extraction tokenizes the text?
                same = _retokenized_equal(tok, records)
            print(f"pass {rep}: regenerate {times['regenerate'][-1]:.2f} s, plain {times['plain'][-1]:.2f} s, "
                  f"prefill {times['prefill'][-1]:.2f} s", flush=True)
            shutil.rmtree(out, ignore_errors=True)
    finally:
        gen.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    regen_tps = statistics.median(tokens["regenerate"]) / med["regenerate"]
    plain_tps = statistics.median(tokens["plain"]) / med["plain"]
    return {
        "model": {"path": Path(model).name, "layers": info.num_hidden_layers, "hidden": info.hidden_size,
                  "vocab": info.vocab_size},
        "rows": len(rows), "rows_per_chunk": rows_per_chunk, "max_new_tokens": max_new_tokens,
        "prompt_tokens": sum(len(p) for p in prompt_ids), "prefill_tokens": prefill_tokens,
        "engine_start_s": round(start_s, 1), "vllm": gen.version, "settings": s.model_dump(mode="json"),
        "seconds": times, "tokens": tokens,
        "regenerate_tok_s": round(regen_tps, 1), "plain_tok_s": round(plain_tps, 1),
        "ratio": round(regen_tps / plain_tps, 4), "target": ">= 0.95", "met": regen_tps / plain_tps >= 0.95,
        "prefill_share": round(med["prefill"] / med["regenerate"], 4),
        "manifest_rows": len(m.rows),
        "retokenized_equal": same,
    }


def _retokenized_equal(tok, records) -> dict:
    """Turns whose generated ids are the first target tokens extraction gets from the chat's text."""
    from datagen.data.chat_tokens import tokenize_chat

    equal = total = 0
    for rec in records:
        for chat, lin in zip(rec.chats, rec.lineage):
            ids, mask = tokenize_chat(tok, chat["messages"])
            targets = ids[mask.astype(bool)].tolist()
            gen = lin["turns"][0]["token_ids"]
            total += 1
            equal += targets[: len(gen)] == gen
    return {"turns": total, "equal": equal}


def _manifest_stub(s, rows: int, chunks: int) -> dict:
    return {"format_version": 1, "source": {"rows": rows}, "model": {}, "tokenizer": {}, "engine": {},
            "settings": s.model_dump(mode="json"), "sampling": s.sampling(), "seed": s.seed,
            "chunks": {"rows_per_chunk": s.rows_per_chunk, "count": chunks}, "totals": {}}


def table(rec: dict) -> str:
    med = {k: statistics.median(v) for k, v in rec["seconds"].items()}
    return "\n".join([
        f"Regeneration vs plain vLLM generate: {rec['rows']} prompts ({rec['prompt_tokens']} tokens), "
        f"{rec['max_new_tokens']} new tokens each, chunks of {rec['rows_per_chunk']}; "
        f"{rec['model']['layers']} layers x {rec['model']['hidden']}, vLLM {rec['vllm']}, "
        f"median of {len(rec['seconds']['plain'])} passes",
        "",
        "| pass | seconds | generated tokens | tokens/s |",
        "|---|---|---|---|",
        f"| regenerate (the step's path, files written) | {med['regenerate']:.2f} | "
        f"{statistics.median(rec['tokens']['regenerate']):.0f} | {rec['regenerate_tok_s']:.0f} |",
        f"| plain vLLM generate, same prompts | {med['plain']:.2f} | "
        f"{statistics.median(rec['tokens']['plain']):.0f} | {rec['plain_tok_s']:.0f} |",
        f"| ratio (target {rec['target']}) | | | {rec['ratio']:.3f} ({'met' if rec['met'] else 'NOT met'}) |",
        f"| prefill-only pass over the regenerated chats ({rec['prefill_tokens']} tokens) | {med['prefill']:.2f} | | "
        f"{rec['prefill_share'] * 100:.1f}% of the regeneration |",
        f"| turns whose text tokenizes back to the generated ids | | | "
        f"{rec['retokenized_equal']['equal']} of {rec['retokenized_equal']['turns']} |",
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="where regenerate.json and regenerate.md go")
    ap.add_argument("--model", help="model directory (default: build a random one under --work)")
    ap.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "regen-bench"))
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU engine: checks the code paths")
    ap.add_argument("--rows", type=int)
    ap.add_argument("--prompt-words", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--rows-per-chunk", type=int, default=256)
    ap.add_argument("--repeats", type=int)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        os.environ.setdefault("DATAGEN_ENFORCE_EAGER", "1")
        os.environ.setdefault("DATAGEN_CPU_KVCACHE_GIB", "1")
    model = args.model or str(work / ("tiny" if args.smoke else "m8b"))
    if not args.model:
        t = time.monotonic()
        build_model(Path(model), smoke=args.smoke)
        print(f"model ready in {time.monotonic() - t:.0f} s", flush=True)
    n = args.rows or (8 if args.smoke else 512)
    rec = measure(model, prompts(n, 20 if args.smoke else args.prompt_words),
                  max_new_tokens=args.max_new_tokens or (16 if args.smoke else 256),
                  repeats=args.repeats or (2 if args.smoke else 3),
                  rows_per_chunk=min(args.rows_per_chunk, 4) if args.smoke else args.rows_per_chunk, work=work)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        import torch

        rec["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001  (recorded as unknown)
        rec["device"] = "unknown"
    (out / "regenerate.json").write_text(json.dumps(rec, indent=1) + "\n")
    t = table(rec)
    (out / "regenerate.md").write_text(t + "\n")
    print(t)


if __name__ == "__main__":
    main()
