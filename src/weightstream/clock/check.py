"""`clockfloor --check`: what this machine offers, read-only and without root."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess

from weightstream.clock.backends import open_backend
from weightstream.clock.config import ClockConfig
from weightstream.clock.devfreq import DevfreqBackend, devfreq_class_dir, list_nodes
from weightstream.clock.procscan import FlagMatcher, read_argv
from weightstream.clock.state import StateFile
from weightstream.clock.uprobe import mapped_libraries, probe_symbols, unavailable_reason
from weightstream.errors import WeightstreamError


def _mhz_list(backend: DevfreqBackend) -> str:
    return " ".join(str(backend.mhz(hz)) for hz in backend.available)


def devfreq_lines(config: ClockConfig) -> list[str]:
    """Every devfreq node, GPU ones in detail."""
    nodes = list_nodes(config.sysfs_root)
    lines = [f"devfreq nodes in {devfreq_class_dir(config.sysfs_root)}: {len(nodes) or 'none'}"]
    for node in nodes:
        lines.append(f"  {node.name} (device {node.device or '?'}){'  GPU' if node.is_gpu() else ''}")
        if not node.is_gpu():
            continue
        try:
            backend = DevfreqBackend(node, config.floor_mhz)
            snapshot = backend.snapshot()
        except (OSError, WeightstreamError) as exc:
            lines.append(f"    unreadable: {exc}")
            continue
        low, high, now = snapshot["original"], node.read_hz("max_freq"), node.read_hz("cur_freq")
        lines.append(
            f"    min {backend.mhz(low)} MHz, max {backend.mhz(high)} MHz, cur {backend.mhz(now)} MHz, "
            f"governor {node.read('governor')}"
        )
        lines.append(f"    available MHz: {_mhz_list(backend)}")
        lines.append(f"    floor during inference: {backend.raised_mhz(snapshot)} MHz (FLOOR={config.floor_label()})")
        writable = os.access(node.path / "min_freq", os.W_OK)
        lines.append(f"    min_freq writable: {'yes' if writable else 'no (the daemon must run as root)'}")
    return lines


def backend_lines(config: ClockConfig, nvml=None) -> tuple[list[str], bool]:
    """Which backend the daemon would use, and whether one opens."""
    try:
        backend = open_backend(config, nvml=nvml)
    except WeightstreamError as exc:
        return [f"backend ({config.backend}): none usable: {exc}"], False
    lines = [f"backend ({config.backend}): {backend.label()}"]
    if backend.kind == "nvml":
        snapshot = backend.snapshot()
        lines.append(f"    supported graphics MHz: {' '.join(map(str, backend.supported_mhz))}")
        lines.append(
            f"    lock during inference: [{snapshot['raised']}, {snapshot['max']}] MHz "
            f"(FLOOR={config.floor_label()}); root needed to set it"
        )
    backend.close()
    return lines, True


def detection_lines(config: ClockConfig) -> list[str]:
    """Each detection method: on or off here, and what it sees now."""
    matcher = FlagMatcher(config.flags)
    matching = _matching_processes(matcher)
    lines = [f"detection (DETECT={' '.join(config.detect)}):"]
    reason = unavailable_reason()
    lines.append(f"  uprobe: {'available, ' + _bpftrace_version() if reason is None else 'unavailable: ' + reason}")
    for pid in matching:
        for library in sorted(mapped_libraries(pid), key=str):
            symbols = probe_symbols(library) if reason is None else ["(symbols need root)"]
            lines.append(f"    pid {pid} maps {library.path}: {' '.join(symbols) or 'no probed functions'}")
    for path in config.libraries:
        lines.append(f"    configured {path}: {'present' if os.path.exists(path) else 'MISSING'}")
    lines.append(f"  announce: socket {config.socket}, {_listener_state(config.socket)}")
    lines.append(f"  poll: flags {' '.join(config.flags)}, busy above {config.cpu_threshold:g} cores")
    for pid, argv in matching.items():
        lines.append(f"    pid {pid}: {' '.join(argv)[:160]}")
    if not matching:
        lines.append("    no process carries these flags now")
    return lines


def _matching_processes(matcher: FlagMatcher) -> dict[int, list[str]]:
    found = {}
    for name in sorted(os.listdir("/proc"), key=lambda n: (len(n), n)):
        if name.isdigit() and int(name) != os.getpid():
            argv = read_argv(int(name)) or []
            if matcher.match(argv):
                found[int(name)] = argv
    return found


def _bpftrace_version() -> str:
    path = shutil.which("bpftrace") or "bpftrace"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        out = "version unknown"
    return f"{path} ({out}), running as root"


def _listener_state(path: str) -> str:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        probe.connect(path)  # succeeds only when a socket is bound there; nothing is sent
        return "a daemon is listening"
    except OSError:
        return "no daemon listening"
    finally:
        probe.close()


def run_check(config: ClockConfig, print_line=print, nvml=None) -> int:
    """Print the report; 0 when a backend is usable, 1 otherwise. Changes nothing."""
    print_line(f"clockfloor check (read-only), settings from {config.source}")
    lines = devfreq_lines(config)
    backend, usable = backend_lines(config, nvml=nvml)
    lines += backend + detection_lines(config)
    state = StateFile(config.state_file).read()
    left = "none" if state is None else f"left by pid {state.get('pid', '?')}"
    lines.append(f"state file {config.state_file}: {left}")
    lines.append(f"hold {config.hold_s:g} s, poll every {config.poll_s:g} s, uprobe rescan every {config.rescan_s:g} s")
    for line in lines:
        print_line(line)
    return 0 if usable else 1
