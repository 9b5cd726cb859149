"""The NVML backend through the daemon's own code, against a fake NVML object, plus the real bindings."""

import inspect
import json
import threading

import pytest

from weightstream.clock.backends import open_backend
from weightstream.clock.config import ClockConfig
from weightstream.clock.daemon import Daemon
from weightstream.clock.nvml import NvmlBackend
from weightstream.errors import WeightstreamError

from clockfakes import (
    FakeNvml,
    burner,
    reap_children,  # noqa: F401  autouse fixture: ends every child a test started
    wait_for,
)


def nvml_config(tmp_path, **changes) -> ClockConfig:
    config = ClockConfig(
        backend="nvml",
        state_file=str(tmp_path / "state.json"),
        socket=str(tmp_path / "a.sock"),
        detect=("poll",),
        sysfs_root=str(tmp_path / "no-sys"),
    )
    for name, value in changes.items():
        setattr(config, name, value)
    return config


@pytest.mark.parametrize("floor, locked", [(None, 1980), (1000, 1005), (1005, 1005), (5000, 1980), (100, 210)])
def test_floor_snaps_to_supported_graphics_clocks(floor, locked):
    backend = NvmlBackend(FakeNvml(), 0, floor)
    snapshot = backend.snapshot()
    assert (snapshot["raised"], snapshot["max"], backend.idle_mhz(snapshot)) == (locked, 1980, 210)
    assert backend.label() == "nvml GPU 0 (Fake H200)"


def test_daemon_locks_during_inference_and_resets_after(tmp_path):
    nvml, lines, config = FakeNvml(), [], nvml_config(tmp_path, floor_mhz=1400.0)
    daemon = Daemon(config, open_backend(config, nvml=nvml), lines.append)
    thread = threading.Thread(target=daemon.run)
    thread.start()
    try:
        assert wait_for(lambda: any("detecting by poll" in line for line in lines), 5) is not None
        child = burner(2.0, "--cpu-moe")
        assert wait_for(lambda: nvml.locked == (1410, 1980), 1.5) is not None, lines
        assert json.loads((tmp_path / "state.json").read_text())["raised"] == 1410
        child.wait()
        assert wait_for(lambda: nvml.locked is None, 2.0) is not None, lines
    finally:
        daemon.stop("test over")
        thread.join(10)
    assert [call for call in nvml.calls if call[0] in ("lock", "reset")] == [("lock", 1410, 1980), ("reset",)]
    assert f"floor 1410 MHz (pid {child.pid} inference, poll --cpu-moe)" in lines
    assert "floor 210 MHz (idle)" in lines and not (tmp_path / "state.json").exists()


def test_stale_nvml_state_is_reset_at_start(tmp_path):
    (tmp_path / "state.json").write_text(json.dumps({"backend": "nvml", "device": 0, "raised": 1980, "pid": 7}))
    nvml, lines = FakeNvml(), []
    daemon = Daemon(nvml_config(tmp_path), open_backend(nvml_config(tmp_path), nvml=nvml), lines.append)
    daemon.run(duration_s=0.2)
    assert ("reset",) in nvml.calls and "repaired a floor left raised by pid 7: locked clocks reset" in lines
    assert not (tmp_path / "state.json").exists()


def test_driver_missing_and_auto_fallback_explain_themselves(tmp_path):
    with pytest.raises(WeightstreamError, match="NVML did not start \\(Driver Not Loaded\\).*driver installed"):
        open_backend(nvml_config(tmp_path), nvml=FakeNvml(fail_init=True))
    with pytest.raises(WeightstreamError) as error:
        open_backend(nvml_config(tmp_path, backend="auto"), nvml=FakeNvml(fail_init=True))
    assert "no GPU devfreq node" in str(error.value) and "Driver Not Loaded" in str(error.value)
    with pytest.raises(WeightstreamError, match="NVML_DEVICE=3 but NVML sees 1 GPU"):
        open_backend(nvml_config(tmp_path, nvml_device=3), nvml=FakeNvml())


def test_lock_refused_by_the_driver_is_a_clear_error(tmp_path):
    nvml = FakeNvml()

    def refuse(handle, low, high):
        raise nvml.NVMLError("Insufficient Permissions")

    nvml.nvmlDeviceSetGpuLockedClocks = refuse
    backend = NvmlBackend(nvml, 0, None)
    with pytest.raises(WeightstreamError, match="Insufficient Permissions.*run as root"):
        backend.apply(backend.snapshot())


def test_fake_matches_the_real_bindings():
    pynvml = pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed (pip install 'weightstream[nvml]')")
    for name, fake in inspect.getmembers(FakeNvml, inspect.isfunction):
        if name.startswith("nvml"):
            real = getattr(pynvml, name)
            assert len(inspect.signature(real).parameters) == len(inspect.signature(fake).parameters) - 1, name
    assert pynvml.NVML_CLOCK_GRAPHICS == FakeNvml.NVML_CLOCK_GRAPHICS
    assert pynvml.NVML_CLOCK_MEM == FakeNvml.NVML_CLOCK_MEM


def test_real_bindings_open_a_gpu_or_say_why_not(tmp_path):
    pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed (pip install 'weightstream[nvml]')")
    try:
        backend = open_backend(nvml_config(tmp_path))
    except WeightstreamError as exc:  # no NVIDIA driver on this machine: the message must say so
        assert "NVML did not start" in str(exc) and "driver" in str(exc)
        return
    try:  # a real GPU: read-only, the clocks are not touched
        snapshot = backend.snapshot()
        assert backend.supported_mhz and snapshot["raised"] <= snapshot["max"] == backend.max_mhz
    finally:
        backend.close()


def test_a_refused_lock_stops_the_daemon_cleanly(tmp_path):
    nvml, lines, config = FakeNvml(), [], nvml_config(tmp_path)

    def refuse(handle, low, high):
        raise nvml.NVMLError("Insufficient Permissions")

    nvml.nvmlDeviceSetGpuLockedClocks = refuse
    daemon = Daemon(config, open_backend(config, nvml=nvml), lines.append)
    child = burner(3.0, "--cpu-moe")
    with pytest.raises(WeightstreamError, match="Insufficient Permissions"):
        daemon.run(duration_s=2.0)
    child.kill()
    assert ("reset",) not in nvml.calls and not (tmp_path / "state.json").exists()
