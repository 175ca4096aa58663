"""Kimi-K2.5's image processor, the project's own: remote code for the tiny checkpoint.

``datagen.testmodels.tiny_kimi`` copies this file into a generated checkpoint as
``kimi_k25_vision_processing.py`` and names its class in ``preprocessor_config.json``'s ``auto_map``
(``AutoImageProcessor``), as the released Kimi-K2.5 checkpoint names its own. transformers'
``AutoImageProcessor.from_pretrained(model_dir, trust_remote_code=True)`` then builds it: that is
how vLLM 0.24.0 (``KimiK25ProcessingInfo`` -> ``cached_get_image_processor``) gets a Kimi-K2.5
image processor, and it asks three things of it:

- ``media_tokens_calculator(item)``: the placeholder tokens of one vision chunk (the prompt
  update expands each ``<|media_pad|>`` to that many);
- ``preprocess(items, return_tensors=...)``: ``pixel_values`` [sum of t*h*w patches, 3, 14, 14]
  float32 and ``grid_thws`` [items, 3] int64 (frames, patch rows, patch columns) for the tower;
- ``num_frames_per_chunk``: the frames of a video chunk (the engine's start-up profile builds one).

Written from the documented behaviour of Kimi-K2.5's image pipeline and ``media_proc_cfg``, with
no code of Moonshot's: an image is scaled down (never up) so that its 14-pixel patches fit
``in_patch_limit`` and neither side exceeds ``patch_limit_on_one_side`` patches, resized bicubic,
padded with black on the right and bottom to a multiple of 28 (patch 14 x the 2x2 merge),
normalized with ``image_mean`` / ``image_std``, and cut into patches row by row; every 2x2 patches
become one token. A video chunk's frames share one layout (``in_patch_limit_each_frame``, capped
by ``in_patch_limit_video`` over the chunk) and are pooled in time into one frame's tokens.

It imports only numpy, Pillow, torch and transformers, so it runs wherever a checkpoint's code runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature

# keys of preprocessor_config.json that are transformers' bookkeeping, not settings of this class
_BOOKKEEPING = ("auto_map", "image_processor_type", "processor_class", "_processor_class")


@dataclass(frozen=True)
class MediaSettings:
    """``media_proc_cfg`` of ``preprocessor_config.json``, the keys the layout depends on."""

    patch_size: int  # pixels per side of a patch (14)
    merge: int  # patches per side of a token (2: a 2x2 merge)
    in_patch_limit: int  # most patches of an image
    patch_limit_on_one_side: int  # most patches along either side
    in_patch_limit_each_frame: int  # most patches of a video frame
    in_patch_limit_video: int | None  # most patches of a whole video chunk, None: no cap
    fixed_output_tokens: int | None  # a fixed token count per item, None: from the layout
    frames_per_chunk: int  # frames of a video chunk (temporal_merge_kernel_size)
    mean: tuple[float, float, float]  # per RGB channel, on [0, 1] values
    std: tuple[float, float, float]

    @classmethod
    def from_config(cls, cfg: dict) -> "MediaSettings":
        merge = cfg["merge_kernel_size"]
        merge = int(merge[0] if isinstance(merge, (list, tuple)) else merge)
        each_frame = cfg.get("in_patch_limit_each_frame")
        return cls(
            patch_size=int(cfg["patch_size"]), merge=merge, in_patch_limit=int(cfg["in_patch_limit"]),
            patch_limit_on_one_side=int(cfg["patch_limit_on_one_side"]),
            in_patch_limit_each_frame=int(cfg["in_patch_limit"] if each_frame is None else each_frame),
            in_patch_limit_video=cfg.get("in_patch_limit_video"), fixed_output_tokens=cfg.get("fixed_output_tokens"),
            frames_per_chunk=int(cfg.get("temporal_merge_kernel_size", 4)),
            mean=tuple(float(v) for v in cfg["image_mean"]), std=tuple(float(v) for v in cfg["image_std"]),
        )

    @property
    def unit(self) -> int:
        """Pixels per side of one token's square (patch x merge: 28)."""
        return self.patch_size * self.merge


@dataclass(frozen=True)
class Layout:
    """Where one image (or each frame of a chunk) lands: its resized size, padding and tokens."""

    width: int  # pixels after the resize, before padding
    height: int
    padded_width: int  # a multiple of the settings' unit
    padded_height: int
    tokens: int  # placeholder tokens of the item

    def grid(self, patch_size: int) -> tuple[int, int]:
        """(patch rows, patch columns) of the padded image."""
        return self.padded_height // patch_size, self.padded_width // patch_size


def layout(width: int, height: int, s: MediaSettings, *, patch_limit: int) -> Layout:
    """The layout of a ``width`` x ``height`` image under ``patch_limit`` patches.

    The scale is the largest of at most 1 that brings the whole patches of each side, multiplied,
    within ``patch_limit`` (a side shorter than a patch counts as one) and each side within
    ``patch_limit_on_one_side`` patches; a scaled side is truncated to whole pixels, at least 1.
    """
    p, side = s.patch_size, s.patch_limit_on_one_side
    whole_patches = max(1, width // p) * max(1, height // p)
    scale = min(1.0, math.sqrt(patch_limit / whole_patches), side * p / width, side * p / height)
    w = min(max(1, int(width * scale)), side * p)
    h = min(max(1, int(height * scale)), side * p)
    pw, ph = -(-w // s.unit) * s.unit, -(-h // s.unit) * s.unit
    tokens = s.fixed_output_tokens if s.fixed_output_tokens is not None else (pw // s.unit) * (ph // s.unit)
    return Layout(width=w, height=h, padded_width=pw, padded_height=ph, tokens=int(tokens))


def _pil(image: Any) -> Image.Image:
    """An item's image as PIL: a PIL image, vLLM's media wrapper (``.media``) or an HWC uint8 array."""
    image = getattr(image, "media", image)
    if isinstance(image, Image.Image):
        return image
    if isinstance(image, np.ndarray):
        return Image.fromarray(image)
    raise ValueError(f"a Kimi-K2.5 vision chunk holds PIL images, not {type(image).__name__}")


def _frames(item: dict) -> list[Image.Image]:
    """The images of one vision chunk: ``{"type": "image", "image": ...}`` or
    ``{"type": "video_chunk", "video_chunk": [...]}``."""
    kind = item.get("type") if isinstance(item, dict) else None
    if kind == "image":
        return [_pil(item["image"])]
    if kind == "video_chunk":
        frames = [_pil(f) for f in item["video_chunk"]]
        if not frames:
            raise ValueError("a video chunk needs at least one frame")
        return frames
    raise ValueError(f"a Kimi-K2.5 vision chunk is an image or a video_chunk, not {kind!r}")


class KimiK25VisionProcessor(BaseImageProcessor):
    """Kimi-K2.5's image processor over ``preprocessor_config.json``'s ``media_proc_cfg``."""

    model_type = "kimi_k25"
    model_input_names = ["pixel_values", "grid_thws"]

    def __init__(self, media_proc_cfg: dict | None = None, **kwargs: Any) -> None:
        if not media_proc_cfg:
            raise ValueError("KimiK25VisionProcessor needs media_proc_cfg (preprocessor_config.json's settings)")
        super().__init__(**{k: v for k, v in kwargs.items() if k not in _BOOKKEEPING})
        self.media_proc_cfg = dict(media_proc_cfg)
        self.settings = MediaSettings.from_config(self.media_proc_cfg)
        self.num_frames_per_chunk = self.settings.frames_per_chunk
        # uint8 value -> float32 per channel, [256, 3]: as is, rescaled to [0, 1], and normalized
        raw = np.repeat(np.arange(256, dtype=np.float32)[:, None], 3, axis=1)
        rescaled = raw / np.float32(255.0)
        mean = np.asarray(self.settings.mean, dtype=np.float32)
        inv_std = np.float32(1.0) / np.asarray(self.settings.std, dtype=np.float32)
        self._tables = {(False, False): raw, (True, False): rescaled,
                        (False, True): (raw - mean[None, :]) * inv_std[None, :],
                        (True, True): (rescaled - mean[None, :]) * inv_std[None, :]}

    @classmethod
    def from_dict(cls, image_processor_dict: dict, **kwargs: Any):
        # transformers passes loader options (``_from_auto``, ``trust_remote_code``, ...) beside
        # the file's keys; only the settings build the processor.
        return_unused = kwargs.pop("return_unused_kwargs", False)
        cfg = dict(image_processor_dict)
        processor = cls(media_proc_cfg=cfg.pop("media_proc_cfg", None))
        return (processor, kwargs) if return_unused else processor

    def to_dict(self) -> dict:
        return {"image_processor_type": type(self).__name__, "media_proc_cfg": dict(self.media_proc_cfg)}

    def item_layout(self, item: dict) -> tuple[Layout, int]:
        """The layout of one vision chunk and its frame count."""
        frames = _frames(item)
        width, height = frames[0].size
        if item["type"] == "image":
            return layout(width, height, self.settings, patch_limit=self.settings.in_patch_limit), 1
        limit = self.settings.in_patch_limit_each_frame
        if self.settings.in_patch_limit_video is not None:
            limit = min(round(self.settings.in_patch_limit_video / len(frames)), limit)
        return layout(width, height, self.settings, patch_limit=limit), len(frames)

    def media_tokens_calculator(self, item: dict) -> int:
        """The placeholder tokens of one vision chunk (what vLLM's prompt update expands to)."""
        return self.item_layout(item)[0].tokens

    def _patches(self, frame: Image.Image, at: Layout, table: np.ndarray) -> np.ndarray:
        """One frame resized, padded with black, mapped through ``table`` (uint8 -> float32 per
        channel) and cut: [rows * cols, 3, p, p] float32."""
        p = self.settings.patch_size
        pixels = np.zeros((at.padded_height, at.padded_width, 3), dtype=np.uint8)
        resized = frame.convert("RGB").resize((at.width, at.height), resample=Image.Resampling.BICUBIC)
        pixels[: at.height, : at.width] = np.asarray(resized)
        normalized = table[pixels, np.arange(3)]  # [H, W, 3]
        rows, cols = at.grid(p)
        return normalized.reshape(rows, p, cols, p, 3).transpose(0, 2, 4, 1, 3).reshape(rows * cols, 3, p, p)

    def preprocess(self, images: list[dict] | dict, return_tensors: Any = None, do_rescale: bool = True,
                   do_normalize: bool = True, **kwargs: Any) -> BatchFeature:
        """``pixel_values`` and ``grid_thws`` of vision chunks, in order (patches of each frame
        row by row, frames in order, items in order). ``do_rescale`` / ``do_normalize`` off give
        the values unscaled / without mean and std (a vLLM that normalizes on the device asks
        for both off: the pixels as 0..255)."""
        table = self._tables[bool(do_rescale), bool(do_normalize)]
        items = images if isinstance(images, list) else [images]
        if not items:
            return BatchFeature(data={}, tensor_type=return_tensors)
        patches, grids = [], []
        for item in items:
            at, _ = self.item_layout(item)
            frames = _frames(item)
            patches += [self._patches(f, at, table) for f in frames]
            grids.append((len(frames), *at.grid(self.settings.patch_size)))
        data = {"pixel_values": torch.from_numpy(np.ascontiguousarray(np.concatenate(patches))),
                "grid_thws": torch.tensor(grids, dtype=torch.int64)}
        return BatchFeature(data=data, tensor_type=return_tensors)

    def __repr__(self) -> str:
        return f"KimiK25VisionProcessor(media_proc_cfg={self.media_proc_cfg})"


__all__ = ["KimiK25VisionProcessor", "MediaSettings", "Layout", "layout"]
