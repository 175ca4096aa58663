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

What the draft is fed (``features``): by default (``target``) the TARGET's own states of the held-out
rows, for the layers the draft's config names, computed here by the transformers reference
(``datagen.engines.hf``, float32), and the target's greedy tokens from its own final state. That is
what vLLM feeds the draft in production (its config's ``eagle_aux_hidden_state_layer_ids``, taken from
the target as it runs), so a dataset whose states are not the layers it claims (an off-by-one
capture) makes a draft that is judged in the world it will serve in, not in its own. The report also
holds, per layer, how far the dataset's stored states are from the target's (``feature_error``): the
direct check of the dataset's labels. ``dataset`` feeds the stored states instead (no target forward;
it cannot catch a mislabelled dataset: the draft is judged in its own world).
"""

from __future__ import annotations

import enum
import json
import logging
from pathlib import Path

import torch
from pydantic import BaseModel, Field

from datagen.training.draft import read_lineage

log = logging.getLogger(__name__)


class PositionAgreement(BaseModel):
    """One speculated position."""

    position: int = Field(description="j: the j-th speculated token (1-based)")
    agreement: float = Field(description="share of slots j whose token is the target's greedy token")
    conditional: float = Field(description="the same among slots whose earlier slots all agreed")
    slots: int = Field(description="slots j measured (held-out assistant positions with a target token there)")


class Features(str, enum.Enum):
    """Whose hidden states the draft is fed when measured."""

    TARGET = "target"  # the target's own states of the held-out rows, at the draft's config layers
    DATASET = "dataset"  # the dataset's stored states (cannot catch a mislabelled dataset)


class FeatureError(BaseModel):
    """How far the dataset's stored states of a layer are from the target's own, on the held-out rows."""

    layer: int = Field(description="the layer id the dataset and the draft claim")
    median: float = Field(description="median over tokens of |stored - target| / |target|")
    p99: float = Field(description="99th percentile of the same")


class AgreementReport(BaseModel):
    """A draft measured on a dataset's held-out rows."""

    draft: str = Field(description="the draft directory")
    dataset: str = Field(description="the dataset measured on")
    dataset_fingerprint: str = Field(description="its manifest fingerprint")
    held_out_samples: int = Field(description="samples measured (the split after train_ratio)")
    positions: list[PositionAgreement] = Field(description="positions 1..k, in order")
    acceptance_length: float = Field(
        description="mean accepted tokens per verification step implied (agreeing run + the bonus token)")
    features: Features = Field(Features.TARGET, description="whose states the draft was fed")
    feature_error: list[FeatureError] = Field(
        default_factory=list,
        description="per layer the draft's config names, and the final one: the dataset's stored states in the "
                    "order the draft takes them against the target's states of that layer (features=target)")


def draft_layer_ids(draft: str | Path) -> list[int]:
    """The aux layers the draft's config names: what vLLM feeds it (``eagle_aux_hidden_state_layer_ids``)."""
    config = json.loads((Path(draft) / "config.json").read_text())
    return list(config["eagle_aux_hidden_state_layer_ids"])


class TargetStates:
    """The target's own states of token rows, by layer id (the project's convention,
    ``datagen.engines.hf``): one model load for every draft measured, each row computed once."""

    def __init__(self, verifier: str | Path, *, dtype: str = "float32", device: str = "cpu") -> None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(verifier)
        self.num_hidden_layers = getattr(config, "text_config", config).num_hidden_layers
        self.verifier, self.dtype, self.device = str(verifier), dtype, device
        self._ref = None
        self._cache: dict[tuple[int, ...], dict[int, torch.Tensor]] = {}

    def states(self, input_ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
        """[T, len(layer_ids), H] float32."""
        if self._ref is None:
            from datagen.engines.hf import HFReference

            self._ref = HFReference(self.verifier, layer_ids=(self.num_hidden_layers,),
                                    num_hidden_layers=self.num_hidden_layers, dtype=self.dtype, device=self.device)
        key = tuple(input_ids.tolist())
        have = self._cache.setdefault(key, {})
        missing = [k for k in layer_ids if k not in have]
        if missing:
            have.update({k: v.float() for k, v in self._ref.states_by_id(input_ids, missing).items()})
        return torch.stack([have[k] for k in layer_ids], dim=1)


def _target_fed(data, target: TargetStates, layer_ids: list[int], errors: dict[int, list[torch.Tensor]]):
    """``data`` (a SpeculatorsDataset) with its states replaced by the target's at ``layer_ids`` + the
    final layer. The distance of the stored states to them, column by column in the order the draft
    takes them (the j-th stored aux layer trained the draft's j-th input), is collected into ``errors``
    by the draft's layer id: a dataset that stored other layers than the draft's config names is far off."""
    final = data.reader.layer_ids[-1]
    wanted = [*layer_ids, final]
    comparable = len(data.reader.layer_ids) == len(wanted)  # the stored states in the order the draft takes them
    get = data._get_raw_data  # noqa: SLF001 (speculators' BaseDataset hook)

    def fed(index: int) -> dict:
        raw = get(index)
        true = target.states(raw["input_ids"], wanted)  # [T, L, H]
        if comparable:
            stored = data.reader[data.indices[index]].hidden_states.float()
            for j, k in enumerate(wanted):
                t = true[:, j]
                errors.setdefault(k, []).append((stored[:, j] - t).norm(dim=-1) / t.norm(dim=-1).clamp_min(1e-6))
        hs = true.to(data.hidden_states_dtype)
        return {**raw, "hidden_states": hs[:, :-1].flatten(1), "verifier_last_hidden_states": hs[:, -1]}

    data._get_raw_data = fed  # noqa: SLF001
    return data


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
                      train_ratio: float | None = None, max_samples: int | None = None,
                      features: Features = Features.TARGET, target: TargetStates | None = None,
                      device: str = "cpu") -> AgreementReport:
    """Measure ``draft`` on ``dataset``'s held-out split (its lineage's ``train_ratio`` unless given).

    ``features``: the target's own states of the held-out rows at the draft's layers (default; pass
    ``target`` to share one loaded target between drafts), or the dataset's stored ones (module
    docstring). ``dataset`` may be another extraction of the same rows: the split is by sample.
    ``device``: where the draft and the target's head run (the counting stays on the CPU).
    """
    from speculators.models.metrics import compute_accepted_length_counts

    from datagen.reader.for_speculators import SpeculatorsDataset
    from datagen.training.draft import _loader
    from datagen.training.layers import as_reader

    model, lineage = load_draft(draft, verifier=verifier)
    settings = lineage.settings
    k = settings.ttt_steps
    reader = as_reader(dataset)
    data = SpeculatorsDataset(reader, max_len=settings.total_seq_len,
                              train_ratio=train_ratio or settings.train_ratio, split="val")
    if max_samples is not None:
        data.indices = data.indices[:max_samples]
        data.approx_lengths = data._compute_approx_lengths()  # noqa: SLF001 (BaseDataset computes it once)
    features = Features(features)
    errors: dict[int, list[torch.Tensor]] = {}
    if features is Features.TARGET:
        target = target or TargetStates(verifier or lineage.verifier, device=device)
        data = _target_fed(data, target, draft_layer_ids(draft), errors)
    model = model.to(device)
    head = _target_head(str(verifier or lineage.verifier)).to(device)
    d2t = getattr(model, "d2t", None)
    d2t = d2t.cpu() if d2t is not None else None
    correct_all, valid_all = [], []
    # in this process: the target-fed dataset wraps a closure, which spawn workers cannot take
    for batch in _loader(data, settings.model_copy(update={"loader_workers": 0}), seed=0):
        on = {key: batch[key].to(device) for key in ("hidden_states", "input_ids", "document_ids", "position_ids",
                                                     "verifier_last_hidden_states")}
        tokens = model(hidden_states=on["hidden_states"].float(), input_ids=on["input_ids"],
                       document_ids=on["document_ids"], position_ids=on["position_ids"], ttt_steps=k)
        doc = batch["document_ids"][0]  # [T], -1 = padding
        mask = batch["loss_mask"][0].bool() & (doc >= 0)
        target = (model.verifier_norm(on["verifier_last_hidden_states"][0].float()) @ head.T).argmax(-1).cpu()  # [T]
        n = doc.shape[0]
        correct = torch.zeros(n, k, dtype=torch.bool)
        valid = torch.zeros(n, k, dtype=torch.bool)
        for j in range(k):
            pred = tokens[j][0].cpu()
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
        draft=str(draft), dataset=str(reader.location), dataset_fingerprint=reader.manifest.fingerprint,
        held_out_samples=len(data), positions=positions, acceptance_length=float(total / blocks) if blocks else 1.0,
        features=features, feature_error=[
            FeatureError(layer=k, median=float(torch.cat(v).median()), p99=float(torch.cat(v).quantile(0.99)))
            for k, v in errors.items()])
    log.info("draft %s on %s (%s states): agreement %s, acceptance length %.3f%s", draft,
             reader.manifest.fingerprint[:12], features.value, " ".join(f"{p.agreement:.3f}" for p in positions),
             report.acceptance_length,
             "; stored vs target states " + ", ".join(f"{e.layer}: {e.median:.3f}" for e in report.feature_error)
             if report.feature_error else "")
    return report
