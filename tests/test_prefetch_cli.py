"""`weightstream prefetch record|run` end to end: real files, real loader processes, real page-cache events."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cli_support import refused_in_process
from prefetch_support import cli, drop, files, loader, make_checkpoint, tracefs_ok

pytestmark = [
    pytest.mark.skipif(not tracefs_ok(), reason="needs root and tracefs (the fallback has its own tests)"),
    pytest.mark.usefixtures("no_proactive_reclaim"),
]
SPEC = ["--spec", "model=test", "loader=read"]


@pytest.fixture()
def ckpt(tmp_path):
    return make_checkpoint(tmp_path / "model")


def _record(home, paths, mode="read", *extra):
    return cli(home, "prefetch", "record", *SPEC, *extra, "--", *loader(mode, paths))


def _run(home, paths, *opts, mode="read", extra=()):
    drop(paths)
    return cli(home, "prefetch", "run", *SPEC, *opts, "--", *loader(mode, paths, *extra))


def test_record_then_run_reproduces_the_loader_output(tmp_path, ckpt):
    paths, home = files(ckpt), tmp_path / "home"
    drop(paths)
    plain = subprocess.run(loader("read", paths), capture_output=True)
    rec = _record(home, paths, "read", "--model-dir", str(ckpt))
    assert rec.returncode == 0, rec.stderr.decode()
    assert rec.stdout == plain.stdout
    assert b"recorded 3 files" in rec.stderr and b"template " in rec.stderr
    report = tmp_path / "r.json"
    # A loader slower than the disk (10 ms per MiB), so that prefetch has something to do before it is done.
    run = _run(home, paths, "--json-report", str(report), extra=("--sleep-per-mib", "0.01"))
    assert run.returncode == 0 and run.stdout == plain.stdout
    doc = json.loads(report.read_text())
    assert doc["template_used"] and doc["source"] == "tracefs"
    total = sum(ckpt.joinpath(p).stat().st_size for p in paths)
    assert doc["bytes_template"] >= total - 8192
    doc.pop("timeline")
    assert 0 < doc["bytes_prefetched"] <= doc["bytes_template"], doc
    assert doc["bytes_used"] is not None and doc["bytes_used"] <= doc["bytes_prefetched"], doc
    issued = doc["bytes_prefetched"] + doc["bytes_abandoned"] + doc["bytes_already_cached"]
    assert issued <= doc["bytes_template"] + (4 << 20), doc
    assert doc["bytes_prefetched"] + doc["bytes_loader_missed"] >= total - (2 << 20), doc  # all came via one of us


def test_record_discovers_model_dir_from_open_files(tmp_path, ckpt):
    paths, home = files(ckpt), tmp_path / "home"
    drop(paths)
    # Discovery samples /proc every 50 ms: the loader maps each file longer than that, as a real one does
    # (unthrottled, these 30 MB can be mapped, read and unmapped between two samples).
    rec = cli(home, "prefetch", "record", *SPEC, "--", *loader("mmap", paths, "--sleep-per-mib", "0.01"))
    assert rec.returncode == 0, rec.stderr.decode()
    assert b"recorded 3 files" in rec.stderr


def test_changed_file_invalidates_template(tmp_path, ckpt):
    paths, home = files(ckpt), tmp_path / "home"
    assert _record(home, paths, "read", "--model-dir", str(ckpt)).returncode == 0
    target = ckpt / "model-00002.safetensors"
    st = target.stat()
    data = bytearray(target.read_bytes())
    data[0] ^= 0xFF  # same size, same mtime after utime, same inode: only the fingerprint can tell
    with open(target, "r+b") as f:
        f.write(data[:1])
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    run = _run(home, paths)
    assert run.returncode == 0
    lines = [line for line in run.stderr.decode().splitlines() if "template ignored" in line]
    assert len(lines) == 1 and "content fingerprint differs" in lines[0]
    assert b"no prefetch" in run.stderr


def test_deleted_file_and_other_spec(tmp_path, ckpt):
    paths, home = files(ckpt), tmp_path / "home"
    assert _record(home, paths, "read", "--model-dir", str(ckpt)).returncode == 0
    other = cli(home, "prefetch", "run", "--spec", "model=other", "--", *loader("read", paths))
    assert other.returncode == 0 and b"no template recorded for spec 'model=other'" in other.stderr
    (ckpt / "model-00001.safetensors").unlink()
    left = [p for p in paths if "00001" not in p]
    run = _run(home, left)
    assert run.returncode == 0 and b"model-00001.safetensors is gone" in run.stderr


def test_corrupt_and_past_end_templates_are_ignored(tmp_path, ckpt):
    from weightstream.prefetch.spec import DeploymentSpec
    from weightstream.prefetch.store import template_path
    from weightstream.prefetch.template import LoadTemplate, WorkerTemplate

    paths, home = files(ckpt), tmp_path / "home"
    want = subprocess.run(loader("read", paths), capture_output=True).stdout
    assert _record(home, paths, "read", "--model-dir", str(ckpt)).returncode == 0
    os.environ["WEIGHTSTREAM_HOME"] = str(home)
    try:
        path = template_path(DeploymentSpec.parse(SPEC[1:]))
    finally:
        del os.environ["WEIGHTSTREAM_HOME"]
    good = LoadTemplate.from_json(path.read_text())
    size = good.files[0].size
    good.workers[0] = WorkerTemplate("loader", good.workers[0].ranges + [(0, size + (8 << 20), 4096)])
    path.write_text(good.to_json())
    run = _run(home, paths)
    assert run.returncode == 0 and run.stdout == want and b"points past the end of the file" in run.stderr
    path.write_text(good.to_json()[:-40])
    run = _run(home, paths)
    assert run.returncode == 0 and run.stdout == want and b"is corrupt" in run.stderr


def test_exit_code_stdin_stdout_stderr_pass_through(tmp_path, ckpt):
    paths, home = files(ckpt), tmp_path / "home"
    assert _record(home, paths, "read", "--model-dir", str(ckpt)).returncode == 0
    prog = (
        "import sys; d = sys.stdin.buffer.read(); sys.stdout.buffer.write(d[::-1]); "
        "sys.stderr.write('to stderr\\n'); sys.exit(7)"
    )
    run = cli(home, "prefetch", "run", *SPEC, "--", sys.executable, "-c", prog, input=b"\x00abc\xff")
    assert run.returncode == 7 and run.stdout == b"\xffcba\x00"
    assert run.stderr.startswith(b"to stderr\n") or b"\nto stderr\n" in run.stderr
    assert all(line.startswith(b"weightstream prefetch: ") for line in run.stderr.splitlines() if line != b"to stderr")


def test_failed_record_saves_nothing_and_passes_exit_code(tmp_path, ckpt):
    paths, home = files(ckpt), tmp_path / "home"
    rec = cli(home, "prefetch", "record", *SPEC, "--", *loader("read", paths, "--exit", "3"))
    assert rec.returncode == 3 and b"template not saved" in rec.stderr
    assert not (home / "templates").exists() or not list((home / "templates").iterdir())


def test_bad_input_is_refused_before_running(tmp_path, monkeypatch):
    """Each refused before any work (in this process, as a new one would refuse it: cli_support)."""
    monkeypatch.setenv("WEIGHTSTREAM_HOME", str(tmp_path / "home"))
    for args, words in (
        (["prefetch", "run", *SPEC], "no command given"),
        (["prefetch", "run", *SPEC, "--memory-budget", "1MiB", "--", "true"], "below one 2 MiB"),
        (["prefetch", "run", *SPEC, "--numa-node", "7", "--", "true"], "--numa-node 7 does not exist"),
        (["prefetch", "run", "--spec", "oops", "--", "true"], "is not KEY=VALUE"),
        (["prefetch", "run", *SPEC, "--", "/no/such/program"], "not found"),
        (["prefetch", "record", *SPEC, "--model-dir", "/no/dir", "--", "true"], "not a directory"),
    ):
        code, err = refused_in_process(*args)
        assert code == 2 and words in err, (args, err)
    assert not (tmp_path / "home").exists() or not any((tmp_path / "home").rglob("*.json"))  # nothing recorded


def test_record_tells_a_two_pass_loader_from_a_one_pass_one(tmp_path, ckpt):
    from weightstream.prefetch.template import LoadTemplate

    paths = files(ckpt)
    for passes, home in ((1, tmp_path / "one"), (2, tmp_path / "two")):
        rec = cli(
            home,
            "prefetch",
            "record",
            *SPEC,
            "--model-dir",
            str(ckpt),
            "--",
            *loader("read", paths, "--passes", str(passes)),
        )
        assert rec.returncode == 0, rec.stderr.decode()
        (path,) = (home / "templates").glob("*.json")
        (worker,) = LoadTemplate.from_json(path.read_text()).workers
        assert abs(worker.reads_per_byte - passes) < 0.2, worker.reads_per_byte


def test_record_notes_a_loader_that_keeps_its_weights_mapped(tmp_path, ckpt):
    from weightstream.prefetch.plan import Plan
    from weightstream.prefetch.template import LoadTemplate

    paths = files(ckpt)
    for hold, home in ((True, tmp_path / "held"), (False, tmp_path / "closed")):
        # Both live on for 1 s after reading; only the first still maps the files meanwhile.
        args = loader("mmap", paths, "--linger", "1.0", *(["--hold"] if hold else []))
        rec = cli(home, "prefetch", "record", *SPEC, "--model-dir", str(ckpt), "--", *args)
        assert rec.returncode == 0, rec.stderr.decode()
        (path,) = (home / "templates").glob("*.json")
        template = LoadTemplate.from_json(path.read_text())
        assert [w.holds_mapped for w in template.workers] == [hold]
        assert template.workers[0].held_files == (list(range(len(template.files))) if hold else [])
        plan = Plan.from_template(template)
        assert plan.no_burn == [False]  # which files it held is known: the rest may be burnt
        # its tensors are the page cache: a held file is never burnt; one it unmapped before the end may be
        assert all(c.shared == hold for c in plan.workers[0])
