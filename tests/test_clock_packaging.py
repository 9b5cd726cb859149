"""The shipped config file and systemd unit agree with the code."""

import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest

from weightstream.clock.config import DEFAULT_CONFIG_PATH, ClockConfig, build_config

PACKAGING = Path(__file__).resolve().parents[1] / "packaging"
UNIT = PACKAGING / "systemd" / "weightstream-clockfloor.service"
CONFIG = PACKAGING / "default" / "weightstream-clockfloor"


def test_shipped_config_parses_to_the_root_defaults(monkeypatch):
    for name in ("WEIGHTSTREAM_HOME", "WEIGHTSTREAM_CLOCKFLOOR_SOCKET"):
        monkeypatch.delenv(name, raising=False)
    shipped = dataclasses.asdict(build_config(str(CONFIG), {}))
    defaults = dataclasses.asdict(ClockConfig())
    assert {key: value for key, value in shipped.items() if key != "source"} == {
        key: value for key, value in defaults.items() if key != "source"
    }


def test_unit_runs_the_daemon_with_the_default_config_and_keeps_its_state_directory(monkeypatch):
    for name in ("WEIGHTSTREAM_HOME", "WEIGHTSTREAM_CLOCKFLOOR_SOCKET"):
        monkeypatch.delenv(name, raising=False)
    text = UNIT.read_text()
    assert f"clockfloor --config {DEFAULT_CONFIG_PATH}\n" in text and "KillSignal=SIGTERM\n" in text
    # systemd creates /run/<RuntimeDirectory>, where the daemon's state file and socket live by default.
    assert "RuntimeDirectory=weightstream-clockfloor\n" in text and "RuntimeDirectoryPreserve=yes\n" in text
    config = ClockConfig()
    assert Path(config.state_file).parent == Path(config.socket).parent == Path("/run/weightstream-clockfloor")


def test_systemd_accepts_the_unit(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not installed: cannot verify the unit here")
    # The only machine-specific part is where weightstream is installed; point it at an existing binary.
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/weightstream", shutil.which("true")))
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    problems = [line for line in (result.stdout + result.stderr).splitlines() if UNIT.name in line]
    assert result.returncode == 0 and not problems, result.stdout + result.stderr
