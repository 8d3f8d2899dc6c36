"""This rank's GPU as the driver sees it (runs on the ranks): utilisation and memory in use, through NVML
(``nvidia-ml-py``, NVIDIA's own binding). Without a driver or a GPU, nothing (None), found out once."""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSample:
    utilization_pct: float
    memory_used_mb: float


class RankGpu:
    """The GPU this rank was given: the first entry of ``CUDA_VISIBLE_DEVICES`` (an index or a UUID), or, where
    that is unset and TensorFlow sees GPUs, ``default_index`` (the rank's local rank, as the session picks it)."""

    def __init__(self, visible: str | None = None, default_index: int | None = None):
        self._handle = None
        visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
        if visible is None and default_index is not None:
            visible = str(default_index)
        first = (visible or "").split(",")[0].strip()
        if not first or first == "-1":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = (pynvml.nvmlDeviceGetHandleByIndex(int(first)) if first.isdigit()
                            else pynvml.nvmlDeviceGetHandleByUUID(first))
        except Exception:  # noqa: BLE001 - no driver, no library, a MIG or unknown id: no GPU figures
            self._handle = None

    def sample(self) -> GpuSample | None:
        if self._handle is None:
            return None
        try:
            util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
            memory = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        except Exception:  # noqa: BLE001 - a GPU that fell off the bus says so in the rank's errors, not here
            return None
        return GpuSample(float(util.gpu), memory.used / 2**20)
