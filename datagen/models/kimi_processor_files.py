"""The image processor a Kimi-K2.5 checkpoint ships: ``preprocessor_config.json`` and the processor's
remote-code file (the project's own ``datagen.models.kimi_processor``, copied in as ``PROCESSOR_FILE``).
"""

from __future__ import annotations

from pathlib import Path

# the image processor's remote-code file and class, the released checkpoint's names
PROCESSOR_FILE, PROCESSOR_CLASS = "kimi_k25_vision_processing.py", "KimiK25VisionProcessor"


def preprocessor_config(*, in_patch_limit: int = 256, patch_limit_on_one_side: int = 32) -> dict:
    """``preprocessor_config.json``: the released checkpoint's ``media_proc_cfg`` keys, with a
    small patch budget (the tiny tower: an image becomes at most ``in_patch_limit / 4`` tokens),
    and the ``auto_map`` entry naming the image processor the checkpoint ships
    (``PROCESSOR_FILE``, the project's ``datagen.models.kimi_processor``). vLLM 0.24 loads that
    class (``trust_remote_code``); vLLM 0.32 reads the same settings with its own processor
    (``KimiK25FusedVisionProcessor``)."""
    return {
        "auto_map": {"AutoImageProcessor": f"{PROCESSOR_FILE[:-3]}.{PROCESSOR_CLASS}"},
        # named here too, so that transformers finds the class without the model's config code
        # (``config.json``'s auto_map names code this checkpoint does not carry)
        "image_processor_type": PROCESSOR_CLASS,
        "media_proc_cfg": {
            "in_patch_limit": in_patch_limit,
            "patch_size": 14,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "merge_kernel_size": 2,
            "fixed_output_tokens": None,
            "patch_limit_on_one_side": patch_limit_on_one_side,
            "in_patch_limit_each_frame": in_patch_limit,
            "in_patch_limit_video": None,
            "sample_fps": 2.0,
            "max_num_frames_each_video": None,
            "temporal_merge_kernel_size": 4,
            "timestamp_mode": "hh:mm:ss.fff",
        },
    }


def write_image_processor(model_dir: str | Path) -> Path:
    """Copy the project's Kimi-K2.5 image processor into ``model_dir`` as ``PROCESSOR_FILE`` (the
    file ``preprocessor_config.json``'s ``auto_map`` names). Returns the file's path."""
    import shutil

    from datagen.models import kimi_processor

    dest = Path(model_dir) / PROCESSOR_FILE
    shutil.copyfile(kimi_processor.__file__, dest)
    return dest


__all__ = ["PROCESSOR_CLASS", "PROCESSOR_FILE", "preprocessor_config", "write_image_processor"]
