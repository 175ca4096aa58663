"""How well a draft predicts the target: per-position top-1 agreement on held-out rows.

For every held-out token position t (an assistant token, speculators' loss mask) the draft
speculates k tokens the way speculators trains it (``Eagle3DraftModel.forward``: step 1 from the
target's aux states at t, step j from its own state of step j-1 and the dataset's token). Slot j
agrees when its token (mapped to the target vocabulary through the draft's ``d2t``) equals the
target's greedy next token there: the argmax of the target's own final norm and full lm_head over
the stored final-layer state. Reported per position j = 1..k:

- ``agreement``: the share of slots j that agree;
- ``conditional``: the same among slots whose slots 1..j-1 all agreed (what speculative decoding
  accepts one step further);

and the acceptance length it implies: per block, the leading run of agreeing slots plus the
target's bonus token (speculators' ``compute_accepted_length_counts``, vLLM's convention), averaged.
Where the dataset's tokens are the target's own greedy output (chats whose assistant turns it
generated), the dataset's token at each step is the token the target accepted, so this is what
vLLM's EAGLE-3 would accept with greedy verification, up to numerics.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from pydantic import BaseModel, Field

from datagen.reader import open_dataset
from datagen.training.draft import read_lineage

log = logging.getLogger(__name__)


class PositionAgreement(BaseModel):
    """One speculated position."""

    position: int = Field(description="j: the j-th speculated token (1-based)")
    agreement: float = Field(description="share of slots j whose token is the target's greedy token")
    conditional: float = Field(description="the same among slots whose earlier slots all agreed")
    slots: int = Field(description="slots j measured (held-out assistant positions with a target token there)")


class AgreementReport(BaseModel):
    """A draft measured on a dataset's held-out rows."""

    draft: str = Field(description="the draft directory")
    dataset: str = Field(description="the dataset measured on")
    dataset_fingerprint: str = Field(description="its manifest fingerprint")
    held_out_samples: int = Field(description="samples measured (the split after train_ratio)")
    positions: list[PositionAgreement] = Field(description="positions 1..k, in order")
    acceptance_length: float = Field(
        description="mean accepted tokens per verification step implied (agreeing run + the bonus token)")


def _target_head(verifier: str):
    """The target's full-vocabulary lm_head weight [V, H] (float32), through speculators' loader."""
    from speculators.utils.loading import load_model_layers

    w = load_model_layers(["embed_tokens.weight", "lm_head.weight"], verifier)
    return w.get("lm_head.weight", w["embed_tokens.weight"]).to(torch.float32)


def load_draft(draft: str | Path, *, verifier: str | Path | None = None):
    """The draft as speculators loads it (``Eagle3DraftModel.from_pretrained``), in eval mode, float32."""
    from speculators.models.eagle3.core import Eagle3DraftModel

    lineage = read_lineage(draft)
    config = Eagle3DraftModel.config_class.from_pretrained(draft)
    config.transformer_layer_config._attn_implementation = "sdpa"  # noqa: SLF001 (never serialized)
    model = Eagle3DraftModel.from_pretrained(str(draft), config=config, verifier=str(verifier or lineage.verifier))
    return model.to(torch.float32).eval(), lineage


@torch.no_grad()
def measure_agreement(draft: str | Path, dataset: str | Path, *, verifier: str | Path | None = None,
                      train_ratio: float | None = None, max_samples: int | None = None) -> AgreementReport:
    """Measure ``draft`` on ``dataset``'s held-out split (its lineage's ``train_ratio`` unless given).

    ``dataset`` may be another extraction of the same rows (e.g. the bf16 one for a draft trained
    on fp8 storage): the split is by sample, so the rows are the same.
    """
    from speculators.models.metrics import compute_accepted_length_counts

    from datagen.reader.for_speculators import SpeculatorsDataset
    from datagen.training.draft import _loader

    model, lineage = load_draft(draft, verifier=verifier)
    settings = lineage.settings
    k = settings.ttt_steps
    reader = open_dataset(dataset)
    data = SpeculatorsDataset(reader, max_len=settings.total_seq_len,
                              train_ratio=train_ratio or settings.train_ratio, split="val")
    if max_samples is not None:
        data.indices = data.indices[:max_samples]
        data.approx_lengths = data._compute_approx_lengths()  # noqa: SLF001 (BaseDataset computes it once)
    head = _target_head(str(verifier or lineage.verifier))
    d2t = getattr(model, "d2t", None)
    correct_all, valid_all = [], []
    for batch in _loader(data, settings, seed=0):
        tokens = model(hidden_states=batch["hidden_states"].float(), input_ids=batch["input_ids"],
                       document_ids=batch["document_ids"], position_ids=batch["position_ids"], ttt_steps=k)
        doc = batch["document_ids"][0]  # [T], -1 = padding
        mask = batch["loss_mask"][0].bool() & (doc >= 0)
        target = (model.verifier_norm(batch["verifier_last_hidden_states"][0].float()) @ head.T).argmax(-1)  # [T]
        n = doc.shape[0]
        correct = torch.zeros(n, k, dtype=torch.bool)
        valid = torch.zeros(n, k, dtype=torch.bool)
        for j in range(k):
            pred = tokens[j][0]
            if d2t is not None:
                pred = pred + d2t[pred]
            # slot j of block t is compared with the target at t + j (speculators' align_for_step)
            m = n - j
            valid[:m, j] = mask[j:] & (doc[j:] == doc[:m])
            correct[:m, j] = (pred[:m] == target[j:]) & valid[:m, j]
        correct_all.append(correct[valid[:, 0]])
        valid_all.append(valid[valid[:, 0]])
    correct, valid = torch.cat(correct_all), torch.cat(valid_all)
    positions = []
    prefix = torch.ones(correct.shape[0], dtype=torch.bool)
    for j in range(k):
        v = valid[:, j]
        cond = v & prefix
        positions.append(PositionAgreement(
            position=j + 1, agreement=float(correct[v, j].float().mean()) if v.any() else 0.0,
            conditional=float(correct[cond, j].float().mean()) if cond.any() else 0.0, slots=int(v.sum())))
        prefix = prefix & correct[:, j]
    total, blocks = compute_accepted_length_counts(correct, valid)
    report = AgreementReport(
        draft=str(draft), dataset=str(dataset), dataset_fingerprint=reader.manifest.fingerprint,
        held_out_samples=len(data), positions=positions, acceptance_length=float(total / blocks) if blocks else 1.0)
    log.info("draft %s on %s: agreement %s, acceptance length %.3f", draft, reader.manifest.fingerprint[:12],
             " ".join(f"{p.agreement:.3f}" for p in positions), report.acceptance_length)
    return report
