"""Parity of image rows: an extracted dataset's states against the engine reference with images.

The reference is ``datagen.engines.vllm_reference`` (eager vLLM, forward hooks on the decoder
layers, one sample per ``generate``, no capture extension), given each sample's images as the
engine gives them. Per captured layer, over the text tokens of image rows (image tokens left out:
their states are the vision tower's output run through the decoder, text tokens are what a draft
trains on): the median and p99 token error against the reference's same layer, and the median
against every other reference layer (an off-by-one must be far). And the images must matter: the
same ids without their images (the placeholders embedded as plain tokens) agree before the first
image and differ after it. And vLLM's own prompt update must expand each image as planning did: the
prompt vLLM ran (``RequestOutput.prompt_token_ids``, after its processor expanded each image's one
placeholder) equals the stored row, placeholder for placeholder (``expansion``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def _samples(out: Path):
    from safetensors.torch import load_file

    m = json.loads((out / "manifest.json").read_text())
    for s in m["shards"]:
        t = load_file(str(out / s["path"]))
        off = t["sample_offsets"].tolist()
        for i, row in enumerate(t["sample_index"].tolist()):
            yield int(row), t["input_ids"][off[i]:off[i + 1]], t["hidden_states"][off[i]:off[i + 1]]


def media_parity(model: str, out: str | Path, data, *, layer_ids: tuple[int, ...], num_hidden_layers: int,
                 dtype: str = "bfloat16", max_seq_len: int = 512, trust_remote_code: bool = True,
                 tensor_parallel_size: int = 1) -> dict:
    """Statistics of the image rows of dataset ``out`` (extracted from plan ``data``, a
    PreparedDataset) against the engine reference. Returns a JSON-able dict (see the module doc)."""
    from datagen.engines.vllm_reference import VllmReference
    from datagen.validation.compare import token_rel_err

    n = num_hidden_layers
    ids_all = tuple(range(n + 1))
    ref = VllmReference(model, num_hidden_layers=n, wanted=ids_all, dtype=dtype, max_seq_len=max_seq_len,
                        trust_remote_code=trust_remote_code, tensor_parallel_size=tensor_parallel_size, media=True)
    errs = {(c, j): [] for c in range(len(layer_ids)) for j in ids_all}
    before, after, rows, image_tokens, text_tokens = [], [], [], 0, 0
    expansion = []
    try:
        for row, ids, got in _samples(Path(out)):
            sample = data.samples[row]
            if not sample.media:
                continue
            assert torch.equal(ids, torch.from_numpy(sample.input_ids)), f"row {row}: the shard's ids are not the plan's"
            text = torch.ones(len(ids), dtype=torch.bool)
            for m in sample.media:
                text[m.offset : m.offset + m.tokens] = False
            expansion.append(_expansion(ref, row, ids, sample.media))
            want = ref.states(ids.tolist(), sample.media)
            blind = ref.states(ids.tolist())  # the same ids, no images
            for c in range(len(layer_ids)):
                for j in ids_all:
                    errs[(c, j)].append(token_rel_err(got[:, c][text], want[j][text]))
            first = sample.media[0].offset
            last = n  # the deepest layer: every token after an image has attended to it
            e = token_rel_err(want[last], blind[last])
            before.append(e[:first])
            after.append(e[first:][text[first:]])
            rows.append(row)
            image_tokens += int((~text).sum())
            text_tokens += int(text.sum())
    finally:
        ref.close()
    if not rows:
        raise ValueError(f"{out} has no image rows")
    layers = {}
    for c, k in enumerate(layer_ids):
        right = torch.cat(errs[(c, k)])
        wrong = {j: float(torch.cat(errs[(c, j)]).median()) for j in ids_all if j != k}
        layers[str(k)] = {"median": float(right.median()), "p90": float(right.quantile(0.9)),
                          "p99": float(right.quantile(0.99)),
                          "nearest_wrong": min(wrong.values()), "nearest_wrong_layer": min(wrong, key=wrong.get)}
    shifted = {str(s): [float(torch.cat(errs[(c, k + s)]).median()) for c, k in enumerate(layer_ids) if 0 <= k + s <= n]
               for s in (-1, 1)}
    return {"rows": rows, "text_tokens": text_tokens, "image_tokens": image_tokens, "layers": layers,
            "expansion": {"rows_equal": sum(e["equal"] for e in expansion), "rows": len(expansion),
                          "per_row": expansion},
            "off_by_one_median": shifted, "reference": ref.kind,
            "without_images": {"before_first_image_max": float(torch.cat(before).max()) if before else 0.0,
                               "after_first_image_median": float(torch.cat(after).median())}}


def _expansion(ref, row: int, ids: torch.Tensor, media) -> dict:
    """The stored row against the prompt vLLM itself expanded from the row's collapsed ids and images
    (one ``generate`` on the reference engine; the states it leaves are dropped by the next
    ``states``): the placeholder tokens of each, and whether the whole prompts are equal."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from datagen.data.media_tokens import engine_prompt

    [out] = ref.llm.generate([TokensPrompt(**engine_prompt(ids.numpy(), media))],
                             SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False)
    expanded = [int(t) for t in out.prompt_token_ids]
    pad = int(ids[media[0].offset])
    stored = ids.tolist()
    return {"row": row, "images": len(media), "planned_tokens": [int(m.tokens) for m in media],
            "stored_placeholders": sum(t == pad for t in stored), "vllm_placeholders": sum(t == pad for t in expanded),
            "stored_len": len(stored), "vllm_len": len(expanded), "equal": expanded == stored}
