"""Choose the clock backend: devfreq where the kernel exposes a GPU devfreq node, else NVML."""

from __future__ import annotations

from weightstream.clock.config import ClockConfig
from weightstream.clock.devfreq import DevfreqBackend, find_gpu_node
from weightstream.clock.nvml import NvmlBackend, load_pynvml
from weightstream.errors import WeightstreamError


def open_backend(config: ClockConfig, nvml=None):
    """The configured backend; `nvml` replaces the pynvml module (tests pass a fake, hardware passes None)."""
    if config.backend == "devfreq":
        return DevfreqBackend(find_gpu_node(config.sysfs_root, config.devfreq_node), config.floor_mhz)
    if config.backend == "nvml":
        return NvmlBackend(nvml or load_pynvml(), config.nvml_device, config.floor_mhz)
    try:
        return DevfreqBackend(find_gpu_node(config.sysfs_root, config.devfreq_node), config.floor_mhz)
    except WeightstreamError as devfreq_error:
        try:
            return NvmlBackend(nvml or load_pynvml(), config.nvml_device, config.floor_mhz)
        except WeightstreamError as nvml_error:
            raise WeightstreamError(f"no GPU clock to floor: devfreq: {devfreq_error}; nvml: {nvml_error}") from None
