"""Discrete NVIDIA GPUs: lock graphics clocks to [floor, max] through NVML, reset them afterwards.

Uses nvidia-ml-py (`pip install 'weightstream[nvml]'`, module `pynvml`). The library object is passed in, so
tests drive this exact code with a fake; on real hardware `load_pynvml()` supplies the real module. Locking
needs root (or the driver's admin setting) and a Volta-or-newer GPU; NVML cannot read back a lock set by
someone else, so restoring means `nvmlDeviceResetGpuLockedClocks` (the driver's default behaviour).
"""

from __future__ import annotations

from weightstream.errors import WeightstreamError


def load_pynvml():
    """The real NVML bindings, or a clear error saying how to install them."""
    try:
        import pynvml
    except ImportError:
        raise WeightstreamError(
            "the NVML backend needs nvidia-ml-py; install it with: pip install 'weightstream[nvml]'"
        ) from None
    return pynvml


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlBackend:
    """Floor through nvmlDeviceSetGpuLockedClocks(floor, max)."""

    kind = "nvml"

    def __init__(self, nvml, index: int, floor_mhz: float | None):
        self.nvml = nvml
        self.index = index
        self.floor_mhz = floor_mhz
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise WeightstreamError(f"NVML did not start ({exc}); is the NVIDIA driver installed and loaded?") from None
        try:
            self._open_device()
        except nvml.NVMLError as exc:
            nvml.nvmlShutdown()
            message = f"NVML device {index}: {exc}; check NVML_DEVICE (nvidia-smi -L lists GPUs)"
            raise WeightstreamError(message) from None
        except WeightstreamError:
            nvml.nvmlShutdown()
            raise

    def _open_device(self) -> None:
        nvml = self.nvml
        count = nvml.nvmlDeviceGetCount()
        if not 0 <= self.index < count:
            raise WeightstreamError(f"NVML_DEVICE={self.index} but NVML sees {count} GPU(s); use 0..{count - 1}")
        self.handle = nvml.nvmlDeviceGetHandleByIndex(self.index)
        self.name = _text(nvml.nvmlDeviceGetName(self.handle))
        self.max_mhz = int(nvml.nvmlDeviceGetMaxClockInfo(self.handle, nvml.NVML_CLOCK_GRAPHICS))
        self.supported_mhz = self._supported_graphics_clocks()

    def _supported_graphics_clocks(self) -> list[int]:
        nvml = self.nvml
        try:
            memory = max(nvml.nvmlDeviceGetSupportedMemoryClocks(self.handle))
            clocks = nvml.nvmlDeviceGetSupportedGraphicsClocks(self.handle, memory)
        except nvml.NVMLError:
            return [self.max_mhz]  # some boards do not list clocks; locking still takes any value in range
        return sorted({int(clock) for clock in clocks if clock <= self.max_mhz}) or [self.max_mhz]

    def label(self) -> str:
        """Where the floor goes, for log lines."""
        return f"nvml GPU {self.index} ({self.name})"

    def require_writable(self) -> None:
        """NVML only says no when asked; permission errors surface on the first raise with a clear message."""

    def snapshot(self) -> dict:
        """The locked range raising would set."""
        supported = self.supported_mhz
        if self.floor_mhz is None:
            target = supported[-1]
        else:
            target = next((mhz for mhz in supported if mhz >= self.floor_mhz), supported[-1])
        return {
            "backend": self.kind,
            "device": self.index,
            "original": supported[0],
            "raised": target,
            "max": self.max_mhz,
        }

    def apply(self, snapshot: dict) -> None:
        """Lock graphics clocks to [raised, max]: only the minimum moves."""
        try:
            self.nvml.nvmlDeviceSetGpuLockedClocks(self.handle, snapshot["raised"], snapshot["max"])
        except self.nvml.NVMLError as exc:
            raise WeightstreamError(
                f"nvmlDeviceSetGpuLockedClocks on GPU {self.index} failed ({exc}); run as root on a Volta or newer GPU"
            ) from None

    def restore(self, snapshot: dict) -> str:
        """Reset locked clocks to the driver's default."""
        if snapshot.get("device") != self.index:
            return f"state names GPU {snapshot.get('device')}, not {self.index}; left as is"
        try:
            self.nvml.nvmlDeviceResetGpuLockedClocks(self.handle)
        except self.nvml.NVMLError as exc:
            raise WeightstreamError(f"nvmlDeviceResetGpuLockedClocks on GPU {self.index} failed ({exc})") from None
        return "locked clocks reset"

    def idle_mhz(self, snapshot: dict) -> int:
        """The floor when no inference runs: the lowest supported clock."""
        return snapshot["original"]

    def raised_mhz(self, snapshot: dict) -> int:
        """The floor during inference."""
        return snapshot["raised"]

    def close(self) -> None:
        """Release NVML."""
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass
