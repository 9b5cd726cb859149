"""Jetson (and other devfreq) GPUs: raise only the node's min_freq, put the original back.

Never writes max_freq, the governor, or any CPU or memory clock: the governor keeps scaling above the
floor, which is what keeps energy per token about equal while the GPU stops sagging to its lowest clock.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from weightstream.errors import WeightstreamError

# Jetson GPU devfreq nodes: 17000000.gpu (JetPack 6), 17000000.ga10b (Orin, JetPack 5), 17000000.gv11b
# (Xavier), 57000000.gpu (Nano), gpu-gpc-0; chip codes are g<letter><digits><a|b>.
GPU_NAME = re.compile(r"gpu|(^|[.,_-])g[a-z]\d{1,3}[ab]($|\W)", re.IGNORECASE)


@dataclass(slots=True, frozen=True)
class DevfreqNode:
    """One /sys/class/devfreq/<name> directory."""

    path: Path
    name: str
    device: str  # basename of the `device` link's target, e.g. 17000000.ga10b
    compatible: str  # the device tree's compatible strings, if exposed

    def read(self, field: str) -> str:
        """One attribute's text, stripped."""
        return (self.path / field).read_text().strip()

    def read_hz(self, field: str) -> int:
        """A frequency attribute as an integer."""
        text = self.read(field)
        try:
            return int(text)
        except ValueError:
            raise WeightstreamError(f"{self.path / field} holds {text!r}, not a frequency") from None

    def available_hz(self) -> list[int]:
        """available_frequencies, sorted ascending."""
        try:
            return sorted(int(word) for word in self.read("available_frequencies").split())
        except ValueError:
            raise WeightstreamError(f"{self.path / 'available_frequencies'} is not a list of frequencies") from None

    def is_gpu(self) -> bool:
        """Whether the node's name, device or compatible string names a GPU."""
        return any(GPU_NAME.search(text) for text in (self.name, self.device, self.compatible) if text)


def devfreq_class_dir(sysfs_root: str) -> Path:
    """<sysfs_root>/class/devfreq."""
    return Path(sysfs_root) / "class" / "devfreq"


def read_node(path: Path) -> DevfreqNode:
    """Describe one devfreq directory (its device link may be missing on odd kernels)."""
    device = ""
    if (path / "device").exists():
        device = os.path.basename(os.path.realpath(path / "device"))
    compatible = ""
    try:
        compatible = (path / "device" / "of_node" / "compatible").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        pass
    return DevfreqNode(path=path, name=path.name, device=device, compatible=compatible)


def list_nodes(sysfs_root: str) -> list[DevfreqNode]:
    """Every devfreq node under the root, GPU or not."""
    directory = devfreq_class_dir(sysfs_root)
    if not directory.is_dir():
        return []
    return [read_node(path) for path in sorted(directory.iterdir())]


def find_gpu_node(sysfs_root: str, wanted: str = "") -> DevfreqNode:
    """The configured node, or the single GPU-looking one; a clear error otherwise."""
    nodes = list_nodes(sysfs_root)
    names = ", ".join(node.name for node in nodes) or "none"
    where = devfreq_class_dir(sysfs_root)
    if wanted:
        for node in nodes:
            if node.name == wanted:
                return node
        raise WeightstreamError(f"devfreq node {wanted!r} not found in {where} (present: {names}); fix DEVFREQ_NODE")
    gpus = [node for node in nodes if node.is_gpu()]
    if not gpus:
        raise WeightstreamError(
            f"no GPU devfreq node in {where} (present: {names}); set DEVFREQ_NODE, "
            "check --sysfs-root, or use --backend nvml on a discrete NVIDIA GPU"
        )
    return gpus[0]


def snap_floor(floor_hz: float | None, available: list[int], max_hz: int, original_hz: int) -> int:
    """The lowest available frequency >= the floor (highest if None), never above max_freq nor below the original."""
    allowed = [hz for hz in available if hz <= max_hz] or available[:1]
    target = allowed[-1] if floor_hz is None else next((hz for hz in allowed if hz >= floor_hz), allowed[-1])
    return max(target, original_hz)


class DevfreqBackend:
    """Floor through a devfreq node's min_freq."""

    kind = "devfreq"

    def __init__(self, node: DevfreqNode, floor_mhz: float | None):
        self.node = node
        self.floor_mhz = floor_mhz
        available = node.available_hz()
        if not available:
            raise WeightstreamError(f"{node.path / 'available_frequencies'} is empty; this node cannot be floored")
        self.available = available
        # Jetson nodes count in Hz; some devfreq drivers use kHz. No GPU runs below 10 MHz, so the size decides.
        self.per_mhz = 1_000_000 if available[-1] >= 10_000_000 else 1_000
        node.read_hz("min_freq")
        node.read_hz("max_freq")

    def label(self) -> str:
        """Where the floor goes, for log lines."""
        return f"devfreq {self.node.name} ({self.node.path})"

    def mhz(self, value: int) -> int:
        """A node value in MHz."""
        return round(value / self.per_mhz)

    def require_writable(self) -> None:
        """Refuse to start when min_freq cannot be written (not root): better than failing mid-inference."""
        path = self.node.path / "min_freq"
        if not os.access(path, os.W_OK):
            raise WeightstreamError(f"{path} is not writable by this user; run clockfloor as root (or via its unit)")

    def snapshot(self) -> dict:
        """What raising would do now: the original min_freq and the snapped target."""
        original = self.node.read_hz("min_freq")
        floor_hz = None if self.floor_mhz is None else self.floor_mhz * self.per_mhz
        target = snap_floor(floor_hz, self.available, self.node.read_hz("max_freq"), original)
        return {"backend": self.kind, "node": str(self.node.path), "original": original, "raised": target}

    def apply(self, snapshot: dict) -> None:
        """Write the raised min_freq."""
        if snapshot["raised"] != snapshot["original"]:
            self._write_min(snapshot["raised"])

    def restore(self, snapshot: dict) -> str:
        """Put the original min_freq back unless someone else changed it since; says what it did."""
        if snapshot.get("node") != str(self.node.path):
            return f"state names node {snapshot.get('node')}, not {self.node.path}; left as is"
        current = self.node.read_hz("min_freq")
        if current != snapshot["raised"]:
            return f"min_freq is {self.mhz(current)} MHz, not the {self.mhz(snapshot['raised'])} MHz we set; left as is"
        if current != snapshot["original"]:
            self._write_min(snapshot["original"])
        return f"min_freq back to {self.mhz(snapshot['original'])} MHz"

    def idle_mhz(self, snapshot: dict) -> int:
        """The floor when no inference runs."""
        return self.mhz(snapshot["original"])

    def raised_mhz(self, snapshot: dict) -> int:
        """The floor during inference."""
        return self.mhz(snapshot["raised"])

    def _write_min(self, value: int) -> None:
        path = self.node.path / "min_freq"
        try:
            with open(path, "w") as handle:
                handle.write(str(value))
        except OSError as exc:
            raise WeightstreamError(f"cannot write {value} to {path} ({exc.strerror}); run as root") from None

    def close(self) -> None:
        """Nothing to release."""
