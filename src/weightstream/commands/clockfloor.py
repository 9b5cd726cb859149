"""`weightstream clockfloor`: hold the GPU's minimum clock up while CPU-expert inference decodes."""

from __future__ import annotations

import argparse
import signal

DESCRIPTION = """\
With a MoE model's experts on the CPU (llama.cpp --cpu-moe, or weightstream streaming experts), the GPU works
in short bursts, looks idle to its governor and sits at its lowest clock while every token waits on it.
clockfloor raises only the GPU's MINIMUM clock while inference runs and puts the original back after --hold
seconds without activity, on SIGTERM/SIGINT, and at the next start if a previous run died with it raised.
It never touches max_freq, the governor, or CPU and memory clocks.

backends:
  devfreq  Jetson: /sys/class/devfreq/<gpu node>/min_freq, snapped to available_frequencies
  nvml     discrete NVIDIA GPU: nvmlDeviceSetGpuLockedClocks(floor, max) (pip install 'weightstream[nvml]')
  auto     devfreq when a GPU devfreq node exists, else nvml

activity (all that are available run together; DETECT in the config file narrows them):
  uprobe    bpftrace on llama_decode/llama_process/llama_synchronize in every libllama.so mapped by a
            process carrying the flags (needs root and bpftrace; re-attached when the library is rebuilt)
  announce  weightstream's own engine announces decode steps on a unix socket (WEIGHTSTREAM_CLOCKFLOOR_SOCKET)
  poll      processes whose argv carries a flag (--cpu-moe -cmoe --n-cpu-moe -ncmoe) and which use CPU

settings come from defaults, then the config file (KEY=value: BACKEND FLOOR HOLD FLAGS LIBRARIES DETECT
SYSFS_ROOT DEVFREQ_NODE NVML_DEVICE CPU_THRESHOLD POLL RESCAN STATE_FILE SOCKET), then these options.

examples:
  weightstream clockfloor --check                 what this machine offers; read-only, no root needed
  sudo weightstream clockfloor --floor 1020       run in the foreground (the systemd unit does this)
  sudo weightstream clockfloor --once             one 1.5 s detection window: raise if inference runs, restore
See docs/clockfloor.md for the systemd unit and the config file.
"""

ONCE_WINDOW_S = 1.5


def register(sub) -> None:
    """Add the clockfloor subcommand."""
    p = sub.add_parser(
        "clockfloor",
        help="hold the GPU minimum clock up during CPU-expert decode (Jetson, NVIDIA)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--backend", choices=("auto", "devfreq", "nvml"), help="clock backend (default auto)")
    p.add_argument(
        "--floor",
        metavar="MHZ|max",
        help="minimum GPU clock during inference, snapped to a supported "
        "frequency at or above it (default max: the highest available)",
    )
    p.add_argument(
        "--hold",
        metavar="SECONDS",
        help="restore the original floor after this long without activity (default 1.0, at least 0.5)",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="KEY=value settings file (default /etc/default/weightstream-clockfloor when it exists)",
    )
    p.add_argument("--sysfs-root", metavar="DIR", help="where sysfs is mounted (default /sys; tests use a fake tree)")
    p.add_argument(
        "--check",
        action="store_true",
        help="print nodes, frequencies, libraries, detection methods and permissions, change nothing, and exit",
    )
    p.add_argument(
        "--once",
        action="store_true",
        help=f"watch for {ONCE_WINDOW_S:g} s, raise the floor if "
        "inference runs, then restore it and exit (a self-test)",
    )
    p.set_defaults(func=run)


def log(line: str) -> None:
    """One daemon log line; journald adds the timestamp."""
    print(line, flush=True)


def run(args) -> int:
    """Build the settings, then check, run once, or run until a signal."""
    from weightstream.clock.backends import open_backend
    from weightstream.clock.check import run_check
    from weightstream.clock.config import build_config, config_path_from
    from weightstream.clock.daemon import Daemon

    overrides = {"BACKEND": args.backend, "FLOOR": args.floor, "HOLD": args.hold, "SYSFS_ROOT": args.sysfs_root}
    config = build_config(config_path_from(args.config), overrides)
    if args.check:
        return run_check(config)
    backend = open_backend(config)
    try:
        daemon = Daemon(config, backend, log)
        for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(number, lambda signum, frame: daemon.stop(signal.Signals(signum).name))
        seen = daemon.run(duration_s=ONCE_WINDOW_S if args.once else None)
    finally:
        backend.close()
    if args.once:
        found = ", ".join(f"pid {pid} ({how})" for pid, how in sorted(seen.items())) or "none"
        log(f"once: inference seen: {found}")
    return 0
