"""Settings, node discovery and floor snapping; bad input fails clearly and changes nothing."""

import json

import pytest

from weightstream.cli import main
from weightstream.clock.config import DEFAULT_FLAGS, build_config, read_config_file
from weightstream.clock.daemon import FloorController
from weightstream.clock.devfreq import DevfreqBackend, find_gpu_node, read_node, snap_floor
from weightstream.clock.state import StateFile
from weightstream.errors import WeightstreamError

from clockfakes import JETSON_HZ, make_devfreq_tree, snapshot_files


def all_files(node):
    """Every attribute including min_freq, text and mtime."""
    return {p.name: (p.read_text(), p.stat().st_mtime_ns) for p in sorted(node.iterdir()) if p.is_file()}


def test_config_file_then_command_line_override(tmp_path):
    path = tmp_path / "clockfloor"
    path.write_text(
        '# comment\nFLOOR=1020\nHOLD = 2.5\nFLAGS="--cpu-moe --x"  # trailing\nDETECT=poll,announce\n'
        "LIBRARIES='/opt/a/libllama.so /opt/b/libllama.so'\n\n"
    )
    config = build_config(str(path), {"FLOOR": "max", "HOLD": None})
    assert config.floor_mhz is None and config.hold_s == 2.5
    assert config.flags == ("--cpu-moe", "--x") and config.detect == ("poll", "announce")
    assert config.libraries == ("/opt/a/libllama.so", "/opt/b/libllama.so")
    assert build_config(None, {}).flags == DEFAULT_FLAGS
    assert build_config(None, {"FLOOR": "918MHz"}).floor_mhz == 918


@pytest.mark.parametrize(
    "line, words",
    [
        ("FLOOR=fast", ["FLOOR='fast'", "not a number", "MHz"]),
        ("FLOOR=-5", ["FLOOR='-5'", "below 1"]),
        ("HOLD=0.1", ["HOLD='0.1'", "below 0.5"]),
        ("BACKEND=cuda", ["BACKEND='cuda'", "auto, devfreq, nvml"]),
        ("DETECT=magic", ["DETECT='magic'", "uprobe, announce, poll"]),
        ("FLAGS=cpu-moe", ["FLAGS='cpu-moe'", "--cpu-moe"]),
        ("FLOR=1020", ["'FLOR=1020'", "known key"]),
        ("FLOOR", ["not KEY=value"]),
    ],
)
def test_bad_config_lines_name_file_key_and_fix(tmp_path, line, words):
    path = tmp_path / "clockfloor"
    path.write_text(f"HOLD=1\n{line}\n")
    with pytest.raises(WeightstreamError) as error:
        build_config(str(path), {})
    assert all(word in str(error.value) for word in words), str(error.value)
    assert str(path) in str(error.value)


def test_missing_config_file_is_an_error(tmp_path):
    with pytest.raises(WeightstreamError, match="cannot be read"):
        read_config_file(str(tmp_path / "absent"))


@pytest.mark.parametrize(
    "config_lines, cli, message",
    [
        (["FLOOR=abc"], [], "FLOOR='abc' in "),
        ([], ["--floor", "abc"], "FLOOR='abc' in the command line"),
        (["BACKEND=opencl"], [], "is not a backend"),
        (["DEVFREQ_NODE=17000000.gv11b"], ["--backend", "devfreq"], "devfreq node '17000000.gv11b' not found"),
        ([], ["--backend", "devfreq", "--sysfs-root", "EMPTY"], "no GPU devfreq node"),
        (["HOLD=soon"], [], "HOLD='soon'"),
    ],
)
def test_cli_bad_values_exit_2_and_change_nothing(tmp_path, capsys, config_lines, cli, message):
    node = make_devfreq_tree(tmp_path / "sys")
    stale = {"backend": "devfreq", "node": str(node), "original": 306000000, "raised": 1020000000, "pid": 1}
    (tmp_path / "state.json").write_text(json.dumps(stale))
    (node / "min_freq").write_text("1020000000\n")  # a stale raised floor must survive a refused start too
    before = all_files(node)
    lines = [f"STATE_FILE={tmp_path / 'state.json'}", f"SOCKET={tmp_path / 'a.sock'}", *config_lines]
    (tmp_path / "c.conf").write_text("\n".join(lines) + "\n")
    (tmp_path / "EMPTY").mkdir()
    args = [str(tmp_path / "EMPTY") if a == "EMPTY" else a for a in cli]
    args = [
        "clockfloor",
        "--config",
        str(tmp_path / "c.conf"),
        *(args if "--sysfs-root" in args else [*args, "--sysfs-root", str(tmp_path / "sys")]),
    ]
    assert main(args) == 2
    assert message in capsys.readouterr().err
    assert all_files(node) == before
    assert json.loads((tmp_path / "state.json").read_text()) == stale
    assert not (tmp_path / "a.sock").exists() and not (tmp_path / "state.json.lock").exists()


def test_unknown_backend_on_command_line_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["clockfloor", "--backend", "cuda"])
    assert stop.value.code == 2 and "invalid choice: 'cuda'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, device, found",
    [
        ("17000000.gpu", "17000000.gpu", True),
        ("17000000.ga10b", "17000000.ga10b", True),
        ("gpu-gpc-0", "gpu-gpc-0", True),
        ("57000000.gpu", "57000000.gpu", True),
        ("devfreq0", "17000000.gv11b", True),
        ("13d00000.host1x", "13d00000.host1x", False),
        ("15340000.vic", "15340000.vic", False),
    ],
)
def test_gpu_node_recognised_by_name_or_device(tmp_path, name, device, found):
    node = make_devfreq_tree(tmp_path, name=name, device=device, others=False)
    assert read_node(node).is_gpu() is found


def test_finder_skips_other_nodes_and_honours_a_named_one(tmp_path):
    make_devfreq_tree(tmp_path)
    assert find_gpu_node(str(tmp_path)).name == "17000000.gpu"
    assert find_gpu_node(str(tmp_path), "13d00000.host1x").name == "13d00000.host1x"


def test_snap_floor_rounds_up_caps_at_max_and_never_lowers():
    assert snap_floor(1000e6, JETSON_HZ, 1020000000, 306000000) == 1020000000
    assert snap_floor(700e6, JETSON_HZ, 1020000000, 306000000) == 714000000
    assert snap_floor(None, JETSON_HZ, 1020000000, 306000000) == 1020000000
    assert snap_floor(None, JETSON_HZ, 816000000, 306000000) == 816000000  # nvpmodel capped max_freq
    assert snap_floor(2000e6, JETSON_HZ, 918000000, 306000000) == 918000000
    assert snap_floor(400e6, JETSON_HZ, 1020000000, 612000000) == 612000000  # user's own higher min stays


def test_khz_nodes_are_converted(tmp_path):
    node = make_devfreq_tree(tmp_path, min_hz=306000, max_hz=1020000, others=False)
    (node / "available_frequencies").write_text(" ".join(str(hz // 1000) for hz in JETSON_HZ))
    backend = DevfreqBackend(read_node(node), 700)
    snapshot = backend.snapshot()
    assert snapshot["raised"] == 714000 and backend.raised_mhz(snapshot) == 714 and backend.idle_mhz(snapshot) == 306


def test_restore_leaves_a_value_someone_else_wrote(tmp_path):
    node = make_devfreq_tree(tmp_path, others=False)
    backend = DevfreqBackend(read_node(node), None)
    snapshot = backend.snapshot()
    backend.apply(snapshot)
    assert (node / "min_freq").read_text() == "1020000000"
    (node / "min_freq").write_text("510000000")
    assert "left as is" in backend.restore(snapshot)
    assert (node / "min_freq").read_text() == "510000000"
    before = snapshot_files(node)
    backend.apply(snapshot)
    assert "back to 306 MHz" in backend.restore(snapshot) and (node / "min_freq").read_text() == "306000000"
    assert snapshot_files(node) == before


def controller(tmp_path, lines):
    """A FloorController on a fake node, fed by hand with pids and times."""
    node = make_devfreq_tree(tmp_path / "sys", others=False)
    backend = DevfreqBackend(read_node(node), 800)
    return node, FloorController(backend, StateFile(str(tmp_path / "state.json")), 1.0, lines.append)


def test_controller_raises_on_first_activity_and_restores_exactly_after_hold(tmp_path):
    lines = []
    node, floor = controller(tmp_path, lines)
    floor.update({}, 10.0)
    assert (node / "min_freq").read_text().strip() == "306000000" and not (tmp_path / "state.json").exists()
    floor.update({4242: "poll --cpu-moe"}, 10.0)
    assert (node / "min_freq").read_text() == "816000000" and (tmp_path / "state.json").exists()
    floor.update({4242: "poll --cpu-moe"}, 10.5)
    floor.update({}, 11.49)  # 0.99 s since the last activity: still held
    assert (node / "min_freq").read_text() == "816000000"
    floor.update({}, 11.5)
    assert (node / "min_freq").read_text() == "306000000" and not (tmp_path / "state.json").exists()
    assert lines == ["floor 816 MHz (pid 4242 inference, poll --cpu-moe)", "floor 306 MHz (idle)"]


def test_repair_only_undoes_our_own_value(tmp_path):
    lines = []
    node, floor = controller(tmp_path, lines)
    stale = {"backend": "devfreq", "node": str(node), "original": 306000000, "raised": 1020000000, "pid": 77}
    (tmp_path / "state.json").write_text(json.dumps(stale))
    (node / "min_freq").write_text("612000000")  # changed since (e.g. after a reboot, nvpmodel): not ours
    floor.repair()
    assert (node / "min_freq").read_text() == "612000000" and not (tmp_path / "state.json").exists()
    assert "left as is" in lines[0]
    (tmp_path / "state.json").write_text("{half a json")
    floor.repair()
    assert "unreadable" in lines[1] and not (tmp_path / "state.json").exists()
