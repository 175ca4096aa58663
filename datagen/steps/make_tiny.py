"""The make-tiny step: ``datagen make-tiny``, a tiny random-weight model, its tokenizer and a chat
dataset (nothing downloaded). The generators are in ``datagen.models``."""

from __future__ import annotations

from pathlib import Path

from datagen.models.tiny import TinyArch, make_chat_dataset, make_model

HELP = "Make a tiny random-weight model, a tokenizer and a chat dataset (nothing downloaded)."


def add_arguments(parser) -> None:
    parser.add_argument("--out", required=True, help="directory to create")
    parser.add_argument("--arch", choices=[a.value for a in TinyArch], default=TinyArch.DEEPSEEK_V3.value)
    parser.add_argument("--layers", type=int, default=8, help="num_hidden_layers")
    parser.add_argument("--rows", type=int, default=64, help="rows of the chat dataset")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kimi", choices=["int4", "none"],
                        help="a tiny Kimi-K2.5 checkpoint instead (datagen.models.tiny_kimi: the wrapper, INT4 experts or "
                             "bf16, a bf16 DeepseekV3 twin in model-bf16) with a Kimi-shaped tiktoken tokenizer")


def main(args) -> dict:
    out = Path(args.out)
    if args.kimi:
        from datagen.models.tiny_kimi import make_tiny_kimi
        from datagen.models.tiny_tiktoken import write_kimi_tokenizer

        vocab = 2048
        paths = make_tiny_kimi(out / "model", quantization=args.kimi, vocab_size=vocab, num_layers=args.layers,
                               seed=args.seed)
        write_kimi_tokenizer(paths.model, vocab_size=vocab)
        data = make_chat_dataset(out / "chat.jsonl", rows=args.rows, seed=args.seed)
        return {"model": str(paths.model), "twin": str(paths.twin), "dataset": str(data)}
    model_dir = make_model(out / "model", arch=TinyArch(args.arch), num_layers=args.layers, seed=args.seed)
    data = make_chat_dataset(out / "chat.jsonl", rows=args.rows, seed=args.seed)
    return {"model": str(model_dir), "dataset": str(data)}
