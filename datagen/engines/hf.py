"""The reference engine: plain transformers, one sample at a time.

It is the oracle for the vLLM engine's tests and for validation's golden-sample
check. Layer id k < N is ``output_hidden_states[k]`` (the residual stream
entering layer k); id N is the input of the final norm, taken with a forward
pre-hook, because ``output_hidden_states[N]`` is the state after the norm.
"""

from __future__ import annotations

import logging

import torch

from datagen.data.contract import ShardRecord
from datagen.data.shards.format import TORCH_DTYPES, ShardJob
from datagen.data.shards.writer import write_shard
from datagen.engines.base import Engine, Handout
from datagen.errors import ModelError

log = logging.getLogger(__name__)


def _final_norm(model) -> torch.nn.Module:
    inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    norm = getattr(inner, "norm", None)
    if norm is None:
        raise ModelError(f"{type(model).__name__} has no final norm at .model.norm", hint="use a supported architecture")
    return norm


class HFReference:
    """Loads a model with transformers and returns [T, L, H] states for token ids."""

    def __init__(self, model_dir: str, *, layer_ids: tuple[int, ...], num_hidden_layers: int,
                 dtype: str = "bfloat16", device: str | None = None, trust_remote_code: bool = False):
        from transformers import AutoModelForCausalLM

        self.layer_ids = tuple(layer_ids)
        self.n = num_hidden_layers
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        try:
            self.model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=TORCH_DTYPES[dtype], trust_remote_code=trust_remote_code
            ).to(self.device).eval()
        except (OSError, ValueError, RuntimeError) as e:
            raise ModelError(f"transformers cannot load {model_dir}: {e}", hint="check the model files") from e
        self._final: torch.Tensor | None = None
        _final_norm(self.model).register_forward_pre_hook(self._grab_final)

    def _grab_final(self, _module, args):
        self._final = args[0]

    @torch.inference_mode()
    def states(self, input_ids) -> torch.Tensor:
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device)[None]
        out = self.model(input_ids=ids, output_hidden_states=True, use_cache=False)
        hs = out.hidden_states
        picked = [self._final[0] if k == self.n else hs[k][0] for k in self.layer_ids]
        return torch.stack(picked, dim=1).cpu()


    @torch.inference_mode()
    def states_by_id(self, input_ids, wanted) -> dict[int, torch.Tensor]:
        """[T, H] states of each layer id in ``wanted`` (0..N; -1: after the final norm)."""
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device)[None]
        hs = self.model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
        pick = {self.n: lambda: self._final[0], -1: lambda: hs[self.n][0]}
        return {k: (pick[k]() if k in pick else hs[k][0]).cpu() for k in wanted}


class HFEngine(Engine):
    name = "hf"

    def __init__(self, model_dir: str, *, layer_ids, num_hidden_layers: int, dtype: str, trust_remote_code: bool = False):
        self._args = dict(model_dir=model_dir, layer_ids=tuple(layer_ids), num_hidden_layers=num_hidden_layers,
                          dtype=dtype, trust_remote_code=trust_remote_code)
        self._ref: HFReference | None = None
        self._done = Handout()

    def start(self) -> None:
        self._ref = HFReference(**self._args)

    def submit(self, job: ShardJob) -> None:
        assert self._ref is not None, "start() first"
        states = [self._ref.states(ids) for ids in job.input_ids]
        self._done.add([write_shard(job, states)])

    def completed(self) -> list[ShardRecord]:
        return self._done.take()

    def finish(self) -> list[ShardRecord]:
        return self.completed()

    def close(self) -> None:
        self._ref = None

    def describe(self) -> dict:
        import transformers

        return {"name": "hf", "version": transformers.__version__, "patches": []}
