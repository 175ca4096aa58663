"""What accelerators this machine has: NVML when ``pynvml`` is importable, else torch.cuda."""

from __future__ import annotations

import enum
import logging

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)


class ProbeSource(str, enum.Enum):
    NVML = "nvml"  # the NVIDIA management library (pynvml): no CUDA context, exact driver version
    TORCH = "torch"  # torch.cuda (initialises CUDA; no driver version)
    NONE = "none"  # neither answered: no GPU


class Device(BaseModel):
    model_config = ConfigDict(frozen=True)

    index: int = Field(description="Device index as CUDA numbers it.")
    name: str = Field(description="Model, e.g. 'NVIDIA H200'.")
    memory_bytes: int = Field(description="Total device memory in bytes.")


class Accelerators(BaseModel):
    """The GPUs this process can see."""

    model_config = ConfigDict(frozen=True)

    source: ProbeSource = Field(description="How they were found.")
    devices: list[Device] = Field(default_factory=list, description="One entry per visible GPU.")
    driver_version: str | None = Field(None, description="NVIDIA driver version (NVML only).")
    cuda_version: str | None = Field(None, description="CUDA version: the driver's (NVML) or torch's build.")
    note: str | None = Field(None, description="Why a probe did not answer, when one failed.")

    @property
    def count(self) -> int:
        return len(self.devices)


def _nvml() -> Accelerators:
    import pynvml

    pynvml.nvmlInit()
    try:
        devices = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else name
            devices.append(Device(index=i, name=name, memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(h).total)))
        driver = pynvml.nvmlSystemGetDriverVersion()
        cuda = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        return Accelerators(
            source=ProbeSource.NVML,
            devices=devices,
            driver_version=driver.decode() if isinstance(driver, bytes) else str(driver),
            cuda_version=f"{cuda // 1000}.{cuda % 1000 // 10}",
        )
    finally:
        pynvml.nvmlShutdown()


def _torch() -> Accelerators:
    import torch

    if not torch.cuda.is_available():
        return Accelerators(source=ProbeSource.NONE, note=f"torch {torch.__version__} sees no CUDA device")
    devices = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        devices.append(Device(index=i, name=props.name, memory_bytes=int(props.total_memory)))
    return Accelerators(source=ProbeSource.TORCH, devices=devices, cuda_version=torch.version.cuda)


def probe() -> Accelerators:
    """NVML first (exact and cheap), then torch; a machine without either has no GPU."""
    notes = []
    try:
        return _nvml()
    except ImportError:
        notes.append("pynvml not installed")
    except Exception as e:  # NVMLError_LibraryNotFound / DriverNotLoaded on a CPU machine
        notes.append(f"NVML: {type(e).__name__}: {e}")
    try:
        acc = _torch()
    except ImportError:
        return Accelerators(source=ProbeSource.NONE, note="; ".join(notes + ["torch not installed"]))
    return acc.model_copy(update={"note": "; ".join(notes + ([acc.note] if acc.note else [])) or None})
