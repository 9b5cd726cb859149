"""clockfloor settings: defaults < config file (/etc/default style KEY=value) < command-line options."""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from weightstream.clock.activity import default_socket_path
from weightstream.errors import WeightstreamError

DEFAULT_CONFIG_PATH = "/etc/default/weightstream-clockfloor"
DEFAULT_FLAGS = ("--cpu-moe", "-cmoe", "--n-cpu-moe", "-ncmoe")
BACKENDS = ("auto", "devfreq", "nvml")
DETECTORS = ("uprobe", "announce", "poll")
# Shorter holds would drop the floor between two polls of a process that is still decoding.
MIN_HOLD_S = 0.5


def default_state_file() -> str:
    """Where a raised floor is recorded; /run is wiped at boot, exactly when the kernel resets min_freq."""
    home = os.environ.get("WEIGHTSTREAM_HOME")
    if home:
        return str(Path(home) / "clockfloor" / "state.json")
    return "/run/weightstream-clockfloor/state.json"


@dataclass(slots=True)
class ClockConfig:
    """Everything the clockfloor daemon needs, validated."""

    backend: str = "auto"
    floor_mhz: float | None = None  # None: the highest available frequency
    hold_s: float = 1.0
    flags: tuple[str, ...] = DEFAULT_FLAGS
    libraries: tuple[str, ...] = ()
    detect: tuple[str, ...] = DETECTORS
    sysfs_root: str = "/sys"
    devfreq_node: str = ""  # empty: find the GPU node by name
    nvml_device: int = 0
    cpu_threshold: float = 0.25  # cores; an idle server waiting for requests uses far less
    poll_s: float = 0.25
    rescan_s: float = 5.0
    state_file: str = field(default_factory=default_state_file)
    socket: str = field(default_factory=default_socket_path)
    source: str = "defaults"

    def floor_label(self) -> str:
        """The floor as the user wrote it."""
        return "max" if self.floor_mhz is None else f"{self.floor_mhz:g} MHz"


def _number(key: str, value: str, where: str, minimum: float, what: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise WeightstreamError(f"{key}={value!r} in {where} is not a number; write {what}") from None
    if not number >= minimum:
        raise WeightstreamError(f"{key}={value!r} in {where} is below {minimum:g}; write {what}")
    return number


def _floor(key: str, value: str, where: str) -> float | None:
    text = value.strip().lower().removesuffix("mhz").strip()
    if text == "max":
        return None
    return _number(key, text, where, 1, "a frequency in MHz such as 1020, or 'max'")


def _choice_list(key: str, value: str, where: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    items = tuple(value.replace(",", " ").split())
    bad = [item for item in items if item not in allowed]
    if bad or not items:
        raise WeightstreamError(f"{key}={value!r} in {where}: expected one or more of {', '.join(allowed)}")
    return items


def _flags(key: str, value: str, where: str) -> tuple[str, ...]:
    items = tuple(value.split())
    if not items or any(not item.startswith("-") for item in items):
        raise WeightstreamError(f"{key}={value!r} in {where}: expected command-line flags such as '--cpu-moe -cmoe'")
    return items


def _backend(key: str, value: str, where: str) -> str:
    if value not in BACKENDS:
        raise WeightstreamError(f"{key}={value!r} in {where} is not a backend; use one of {', '.join(BACKENDS)}")
    return value


# key -> (dataclass field, parser). Parsers raise WeightstreamError naming the key, value and source.
PARSERS = {
    "BACKEND": ("backend", _backend),
    "FLOOR": ("floor_mhz", _floor),
    "HOLD": ("hold_s", lambda k, v, w: _number(k, v, w, MIN_HOLD_S, "seconds, e.g. 1.0")),
    "FLAGS": ("flags", _flags),
    "LIBRARIES": ("libraries", lambda k, v, w: tuple(v.split())),
    "DETECT": ("detect", lambda k, v, w: _choice_list(k, v, w, DETECTORS)),
    "SYSFS_ROOT": ("sysfs_root", lambda k, v, w: v),
    "DEVFREQ_NODE": ("devfreq_node", lambda k, v, w: v),
    "NVML_DEVICE": ("nvml_device", lambda k, v, w: int(_number(k, v, w, 0, "a GPU index such as 0"))),
    "CPU_THRESHOLD": ("cpu_threshold", lambda k, v, w: _number(k, v, w, 0.01, "cores, e.g. 0.25")),
    "POLL": ("poll_s", lambda k, v, w: _number(k, v, w, 0.02, "seconds, e.g. 0.25")),
    "RESCAN": ("rescan_s", lambda k, v, w: _number(k, v, w, 0.2, "seconds, e.g. 5")),
    "STATE_FILE": ("state_file", lambda k, v, w: v),
    "SOCKET": ("socket", lambda k, v, w: v),
}


def read_config_file(path: str) -> dict[str, str]:
    """KEY=value lines, '#' comments, shell quoting; unknown keys are errors so typos do not pass silently."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise WeightstreamError(f"config file {path} cannot be read ({exc.strerror}); check --config") from None
    values: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        try:
            words = shlex.split(line, comments=True)
        except ValueError as exc:
            raise WeightstreamError(f"{path}:{number}: {exc}; fix the quoting") from None
        if not words:
            continue
        key, sep, value = " ".join(words).partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in PARSERS:
            known = ", ".join(PARSERS)
            raise WeightstreamError(f"{path}:{number}: {line.strip()!r} is not KEY=value with a known key ({known})")
        values[key] = value
    return values


def build_config(file_path: str | None, overrides: dict[str, str]) -> ClockConfig:
    """Merge defaults, the config file and command-line overrides (already keyed like the file)."""
    config = ClockConfig()
    layers = []
    if file_path:
        layers.append((read_config_file(file_path), file_path))
        config.source = file_path
    layers.append(({k: v for k, v in overrides.items() if v is not None}, "the command line"))
    for values, where in layers:
        for key, value in values.items():
            name, parse = PARSERS[key]
            setattr(config, name, parse(key, value, where))
    return config


def config_path_from(argument: str | None) -> str | None:
    """--config if given, else the installed default file when it exists."""
    if argument:
        return argument
    env = os.environ.get("WEIGHTSTREAM_CLOCKFLOOR_CONFIG")
    if env:
        return env
    return DEFAULT_CONFIG_PATH if os.path.exists(DEFAULT_CONFIG_PATH) else None
