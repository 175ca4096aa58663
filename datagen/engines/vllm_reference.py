"""The engine-side golden reference: vLLM in eager mode, forward hooks on its decoder layers.

For models the transformers reference cannot load (Kimi-K2.5: ``kimi_k25`` is not a causal-LM
class of transformers, and a 1T-parameter model does not fit a CPU host), validation
re-extracts golden samples with vLLM itself, on the host that holds the model, but through a
path that shares nothing with the capture it checks:

* no capture extension, no aux-hidden-state path, no ``execute_model_state``: PyTorch forward
  pre-hooks on the model's decoder layers and its final norm read the residual stream;
* eager (``enforce_eager``: no torch.compile, no CUDA graphs, so hooks run);
* one sample per ``generate``, chunked prefill off and a token budget of the whole sample: no
  batch neighbours, no chunk boundaries;
* prefix caching off.

Layer id k < N is the input of decoder layer k (``hidden_states + residual``, taken before the
layer's fused add-norm overwrites them); id N is the input of the final norm, and the final
norm's output is kept as well (validation checks that the stored id N is not it).
States are captured on tensor-parallel rank 0 (every rank holds the full states after the
all-reduce) and handed to the driver through the worker's RPC, one sample at a time: golden
samples are few.
"""

from __future__ import annotations

import logging
import time

import torch

from datagen.engines import patches
from datagen.engines.vllm_devices import set_process_env
from datagen.engines.vllm_llm import llm_kwargs, start_llm
from datagen.errors import ModelError
from datagen.models.modelinfo import inspect_model

log = logging.getLogger(__name__)

EXTENSION = "datagen.engines.vllm_reference.HookExtension"
POST_NORM = -1  # key of the final norm's output in a states dict


def _decoder_layers(model, num_hidden_layers: int):
    """The decoder layers (a ModuleList of N) and the final norm after them, wherever the
    architecture nests its language model (``model.layers``, ``language_model.model.layers``)."""
    for name, mod in model.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(mod, torch.nn.ModuleList) and len(mod) == num_hidden_layers:
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            norm = getattr(parent, "norm", None)
            if norm is not None:
                return mod, norm
    raise ModelError(f"{type(model).__name__} has no list of {num_hidden_layers} decoder layers followed by a norm",
                     hint="the engine-side golden reference supports decoder-only language models")


def _arg(args, kwargs, i: int, name: str):
    return args[i] if len(args) > i else kwargs.get(name)


def _residual_sum(hidden, residual) -> torch.Tensor:
    # A new tensor: the layer's fused add-norm then updates hidden and residual in place.
    return (hidden if residual is None else hidden + residual).detach().to("cpu", copy=True)


class HookExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); reached by collective_rpc."""

    def datagen_ref_install(self, num_hidden_layers: int, wanted: list[int]) -> int:
        """Hook the layers whose states ``wanted`` names (ids 0..N, ``POST_NORM``)."""
        from vllm.distributed import parallel_state as ps

        model = self.model_runner.get_model()
        layers, norm = _decoder_layers(model, num_hidden_layers)
        self._datagen_ref = {}
        self._datagen_ref_rank0 = ps.get_tensor_model_parallel_rank() == 0
        store = self._datagen_ref

        def layer_hook(k):
            def hook(_mod, args, kwargs):
                store.setdefault(k, []).append(_residual_sum(_arg(args, kwargs, 1, "hidden_states"),
                                                             _arg(args, kwargs, 2, "residual")))
            return hook

        def norm_pre(_mod, args, kwargs):
            store.setdefault(num_hidden_layers, []).append(_residual_sum(_arg(args, kwargs, 0, "x"),
                                                                         _arg(args, kwargs, 1, "residual")))

        def norm_post(_mod, _args, _kwargs, out):
            out = out[0] if isinstance(out, tuple) else out
            store.setdefault(POST_NORM, []).append(out.detach().to("cpu", copy=True))

        for k in wanted:
            if 0 <= k < num_hidden_layers:
                layers[k].register_forward_pre_hook(layer_hook(k), with_kwargs=True)
        if num_hidden_layers in wanted:
            norm.register_forward_pre_hook(norm_pre, with_kwargs=True)
        if POST_NORM in wanted:
            norm.register_forward_hook(norm_post, with_kwargs=True)
        return len(wanted)

    def datagen_ref_take(self) -> dict | None:
        """The states of the forward passes since the last call (rank 0), then forget them."""
        if not getattr(self, "_datagen_ref_rank0", False):
            self._datagen_ref.clear()
            return None
        # Plain bytes: the RPC's serializer turns tensors into nested lists.
        out = [[k, [_to_wire(t) for t in v]] for k, v in self._datagen_ref.items()]
        self._datagen_ref.clear()
        return {"states": out}


def _to_wire(t: torch.Tensor) -> list:
    t = t.contiguous()
    return [list(t.shape), str(t.dtype).removeprefix("torch."), t.view(torch.uint8).numpy().tobytes()]


def _from_wire(w: list) -> torch.Tensor:
    shape, dtype, raw = w
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)


def _multimodal(model_dir: str, *, trust_remote_code: bool) -> bool:
    """Whether the model is a multimodal wrapper (``ModelInfo.multimodal``). A directory this process
    cannot read a model from counts as one: vLLM's own process layout then, which holds every
    model, and vLLM's load says what is wrong with it."""
    try:
        return inspect_model(model_dir, trust_remote_code=trust_remote_code).multimodal
    except ModelError:
        return True


class VllmReference:
    """Loads the model in a plain eager vLLM engine and returns [T, H] states per layer id."""

    kind = "vllm-eager-hooks"

    def __init__(self, model_dir: str, *, num_hidden_layers: int, wanted: tuple[int, ...], dtype: str,
                 max_seq_len: int, trust_remote_code: bool = False, tensor_parallel_size: int = 1,
                 media: bool = False):
        self.n = num_hidden_layers
        self.wanted = tuple(sorted(set(wanted)))
        t0 = time.monotonic()
        # What vLLM reads from the environment, by the rule every engine here starts under
        # (vllm_devices.set_process_env): the CPU's KV cache size and each rank's cores, the
        # engine core in this process at TP 1 on the CPU where it can run there (not for a
        # multimodal model: its processor loads numba, which vLLM's worker start trips over), and
        # whatever an engine started before in this process left set is set again.
        set_process_env(on_cuda=torch.cuda.is_available(), tensor_parallel_size=tensor_parallel_size,
                        multimodal=media or _multimodal(model_dir, trust_remote_code=trust_remote_code))
        budget = max(max_seq_len + 1, 16)
        kwargs = llm_kwargs(model_dir, skip_tokenizer_init=not media, dtype=dtype,
                            tensor_parallel_size=tensor_parallel_size, max_model_len=budget, max_num_seqs=1,
                            max_num_batched_tokens=budget, trust_remote_code=trust_remote_code,
                            attention_backend=None)
        # eager, so the hooks run; one sample per pass, in one chunk, every token computed (module docstring)
        kwargs.update(enforce_eager=True, enable_prefix_caching=False, enable_chunked_prefill=False,
                      worker_extension_cls=EXTENSION)
        try:
            # a refused setting or a model vLLM cannot load: as from the other engines (start_llm)
            self.llm = start_llm(kwargs, version=patches.installed_vllm_version())
        except RuntimeError as e:
            raise ModelError(f"vLLM cannot load {model_dir} for the golden reference: {e}",
                             hint="check the model files and that this host can hold the model") from e
        self.llm.collective_rpc("datagen_ref_install", args=(self.n, list(self.wanted)))
        self.start_seconds = time.monotonic() - t0
        log.info("golden reference: eager vLLM with layer hooks started in %.1fs", self.start_seconds)

    @torch.inference_mode()
    def states(self, input_ids, media=()) -> dict[int, torch.Tensor]:
        """[T, H] per layer id; ``media``: the sample's images (``MediaItem``), handed to vLLM as
        the engine hands them (``input_ids`` hold their expanded placeholders)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        ids = [int(t) for t in input_ids]
        self.llm.collective_rpc("datagen_ref_take")  # drop anything a warm-up left
        if media:
            from datagen.data.media_tokens import engine_prompt

            prompt = TokensPrompt(**engine_prompt(torch.tensor(ids).numpy(), media))
        else:
            prompt = TokensPrompt(prompt_token_ids=ids)
        self.llm.generate([prompt],
                          SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False)
        [reply] = [r for r in self.llm.collective_rpc("datagen_ref_take") if r is not None]
        got = {int(k): [_from_wire(w) for w in v] for k, v in reply["states"]}
        out = {}
        for k in self.wanted:
            chunks = got.get(k) or []
            # one prefill pass of the whole sample; a later pass (none with max_tokens=1) is ignored
            if not chunks or chunks[0].shape[0] < len(ids):
                raise ModelError(f"the golden reference saw {[c.shape[0] for c in chunks]} tokens at layer {k}, "
                                 f"expected one pass of {len(ids)}", hint="report this as a bug")
            out[k] = chunks[0][: len(ids)]
        return out

    def close(self) -> None:
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception:  # best effort: the process is ending anyway
            pass
