"""Fault injection with nothing lost (issue 52, item 4): `weightstream synth`, `quantize`, `import` (a GGUF file)
and the warm-restart save of `generate --warm-restart` killed with SIGKILL at seeded random points, and the three
commands that write an --out run on a full disk.

Each kill is of a real `python -m weightstream.cli` process, at one of these points (drawn per operation from a
seeded generator, so a run is reproducible):

- files N: when the run's hidden work directory first holds N entries (N drawn from 0 to all of them: mid-write,
  a file created and partly written);
- swap: as the run renames its finished work directory onto --out (a Python audit hook in the killed process,
  tests/fault_support.py: that instant is microseconds wide), after moving an old --out aside under --force;
- done: once the new --out is in place, before the process has exited;
- for the warm-restart save: inside the save (at its rename, by the same hook: the temporary file written, the state
  not yet replaced), right after the save, or at a random moment of the run (up to the last run's length).

Each run starts where the kill before it left off (its hidden directories, an --out now complete: then with --force).
After every kill: --out is absent or complete (the reference output's bytes, and it maps as a model), the source is
byte-identical, and nothing but hidden work directories is left; a complete --out makes a rerun without --force a
one-line error naming it and --force. The last rerun finishes, removing (and naming) what dead runs left. The
warm state is after every kill either the one before or the new one, whole and accepted; the next run removes a
killed save's temporary file.

The disk-full cases mount a small tmpfs as --out's parent (skipped, saying so, where mounting is not permitted; where
it is, writing past its size is first checked to fail with ENOSPC): an output far larger than the disk is refused
before any work, one that fits its tensors but not the rest fails as it writes, and --force over an output already
there with no room for a second is refused with the old one kept; each a one-line error naming the folder, its free
space and about what is needed, exit 2, no traceback, the disk left as it was. The warm-restart save on a full disk
is said and the previous state kept.

Kill points: DEFAULT_KILLS per operation by default (each of files, swap, done once; the warm save: after, inside,
a random moment); more with the environment variable WEIGHTSTREAM_FAULT_KILLS, e.g.

    WEIGHTSTREAM_FAULT_KILLS=20 .venv/bin/python -m pytest -q -s tests/test_fault_injection.py

(`-s` shows each operation's tally: the kill points, what each left, and how many lost or damaged anything: 0).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections import Counter
from dataclasses import dataclass

import pytest

from weightstream.cache.warm import read_state, state_path
from weightstream.store.checkpoint import open_checkpoint
from weightstream.store.model import map_model
from weightstream.store.outdir import built_in_place
from weightstream.store.presets import preset_config
from weightstream.store.synth import synthesize
from weightstream.units import page_ceil

from cli_support import assert_one_line_error, ran_in_process
from fault_support import entries, fill, inode, kills, run_killed, tmpfs
from fuzz_support import digest
from gguf_support import built_once, gguf_from

DEFAULT_KILLS = 3
OPS = ("synth", "quantize", "import")
LAYERS = 16  # shards enough that a kill by entry count lands between and inside files
IMPORT_SIZES = {"num_hidden_layers": LAYERS, "hidden_size": 128, "head_dim": 32, "moe_intermediate_size": 256}


@dataclass(slots=True)
class Operation:
    name: str  # the command, and the prefix of its hidden work directories
    args: list  # before --out
    source: str | None  # what it reads (synth reads nothing)
    reference: str  # its output, written by a run to its end


@pytest.fixture(scope="module")
def operation(tmp_path_factory):
    def make(name: str) -> Operation:
        base = tmp_path_factory.mktemp(name)
        if name == "synth":
            args, source = ["synth", "--preset", "tiny", "--layers", LAYERS, "--dtype", "fp32", "--seed", 7], None
        elif name == "quantize":
            source = str(base / "model")
            synthesize(source, {**preset_config("tiny", "qwen3_moe"), "num_hidden_layers": LAYERS}, "fp32", seed=3)
        else:  # wider experts than the tiny preset's: the import copies the file's blocks as they are, a short write
            model = str(base / "model")
            synthesize(model, {**preset_config("tiny", "qwen3_moe"), **IMPORT_SIZES}, "bf16", seed=3)
            source = gguf_from(model, base / "model.gguf", lambda layer, proj: "Q8_0")
        if name != "synth":
            args = [name, source] + (["--bits", 8] if name == "quantize" else [])
        reference = str(base / "reference" / "out")
        code, _, err = ran_in_process(*args, "--out", reference)
        assert code == 0, err
        return Operation(name, args, source, reference)

    return built_once(make)


def hidden(parent, name: str) -> list[str]:
    """The hidden work directories of `name` runs in `parent` (the work directory, or an old --out moved aside)."""
    return sorted(e for e in os.listdir(parent) if e.startswith(f".{name}-"))


def assert_complete(out: str, reference: str) -> None:
    """`out` is the whole output: the reference's files, byte for byte, and it maps as a model."""
    assert sorted(os.listdir(out)) == sorted(os.listdir(reference)), (os.listdir(out), os.listdir(reference))
    assert digest(out) == digest(reference), f"{out} differs from a run to its end"
    map_model(out)  # config, index, every shard's header, the manifest


def kill_points(rng: random.Random, n: int, first: list[str], weights: dict[str, int]) -> list[str]:
    """`n` kinds of kill point: `first`, then drawn by `weights`."""
    return [first[i] if i < len(first) else rng.choices(list(weights), list(weights.values()))[0] for i in range(n)]


@pytest.mark.parametrize("name", OPS)
def test_a_killed_run_leaves_its_output_absent_or_complete_and_the_rerun_finishes(operation, name, tmp_path):
    op = operation(name)
    parent = tmp_path / "parent"
    parent.mkdir()
    out = str(parent / "out")
    source = digest(op.source) if op.source else None
    rng = random.Random(f"weightstream-fault-{name}")
    size = len(os.listdir(op.reference))  # its entries, the ownership record included
    tally, hidden_left = Counter(), 0
    first = ["files", "swap", "done"]
    rng.shuffle(first)
    for i, kind in enumerate(kill_points(rng, kills(DEFAULT_KILLS), first, {"files": 3, "swap": 1, "done": 1})):
        force = os.path.lexists(out)
        old, before = inode(out), set(hidden(parent, name))
        n = rng.randint(0, size) if kind == "files" else None

        def replaced(_elapsed, old=old) -> bool:
            return inode(out) not in (None, old)

        def written(elapsed, before=before, n=n) -> bool:  # the work directory holds n entries (or is in place)
            new = [d for d in hidden(parent, name) if d not in before and "-old-" not in d]
            return (bool(new) and entries(parent / new[0]) >= n) or replaced(elapsed)

        run = run_killed(
            [*op.args, "--out", out, *(["--force"] if force else [])],
            tmp_path / f"run{i}",
            trigger={"files": written, "done": replaced}.get(kind),
            kill_at_rename=out if kind == "swap" else None,
        )
        point = f"{kind} {n}" if kind == "files" else kind
        assert run.killed, f"{point}: the run ended with {run.code} before it was killed: {run.stderr}"
        assert "Traceback" not in run.stderr, run.stderr
        if op.source:
            assert digest(op.source) == source, f"{point}: the source changed"
        left = hidden(parent, name)
        assert set(os.listdir(parent)) <= {"out", *left}, os.listdir(parent)
        now = inode(out)
        if kind != "files":  # swap: killed as it renames its finished work onto --out; done: just after
            assert (now not in (None, old)) == (kind == "done") and (kind == "done" or left), (point, left)
        if now is not None:
            assert_complete(out, op.reference)
            tally[f"{point}: " + ("the old --out kept" if now == old else "complete")] += 1
            if not force:  # a rerun without --force says what is there
                code, _, err = ran_in_process(*op.args, "--out", out)
                assert_one_line_error(code, err, name, f"{out}: exists and is not empty", "--force to replace it")
        else:
            tally[f"{point}: absent"] += 1
        hidden_left += len(left)
    force = ["--force"] if os.path.lexists(out) else []
    stale = hidden(parent, name)
    code, _, err = ran_in_process(*op.args, "--out", out, *force)
    assert code == 0 and "Traceback" not in err, err
    assert_complete(out, op.reference)
    assert os.listdir(parent) == ["out"], os.listdir(parent)  # what dead runs left is gone ...
    for d in stale:  # ... and said
        assert f"weightstream {name}: removed {parent / d} (" in err and "left by an earlier run" in err, err
    if op.source:
        assert digest(op.source) == source
    print(
        f"\n{name}: {sum(tally.values())} kills, 0 lost or damaged: {dict(sorted(tally.items()))}; "
        f"{hidden_left} hidden work directories seen after them, all gone after the rerun"
    )


def test_a_live_runs_work_directory_is_not_taken_for_a_dead_ones(tmp_path):
    """The next run removes only what dead runs left: a work directory whose run is alive (it holds its lock, as
    `built_in_place` does here) is left alone by a run into the same folder, and still becomes its --out."""
    parent = tmp_path / "parent"
    with built_in_place(str(parent / "first"), "synth") as live:
        with open(os.path.join(live, "written.txt"), "w") as f:
            f.write("a live run's file")
        code, _, err = ran_in_process("synth", "--preset", "tiny", "--out", parent / "second")
        assert code == 0 and "removed" not in err, err
        assert os.listdir(live) == ["written.txt"]
    assert sorted(os.listdir(parent)) == ["first", "second"]
    assert sorted(os.listdir(parent / "first")) == [".weightstream-output.json", "written.txt"]


def test_a_killed_warm_restart_save_leaves_the_state_whole(tiny_model, tmp_path):
    model = str(tmp_path / "model")
    shutil.copytree(tiny_model("qwen3_moe"), model, ignore=shutil.ignore_patterns(".weightstream"))
    state = state_path(model)
    weights = {e: digest(os.path.join(model, e)) for e in os.listdir(model)}
    layout = map_model(model).layout
    args = ["generate", model, "--max-new-tokens", 6, "--warm-restart", "--expert-cache", "1x", "--io-threads", 2]
    code, _, err = ran_in_process(*args, "--prompt-ids", "1,2,3")  # a state to keep
    assert code == 0 and read_state(state, layout) is not None, err
    rng = random.Random("weightstream-fault-warm")
    # first after a save (its length bounds the random moments), then inside one, then at a random moment
    points = kill_points(rng, kills(DEFAULT_KILLS), ["saved", "save", "moment"], {"save": 2, "saved": 1, "moment": 1})
    tally, last_s = Counter(), None
    for i, kind in enumerate(points):
        prompt = ",".join(str(rng.randrange(1, 500)) for _ in range(rng.randint(2, 12)))
        with open(state, "rb") as f:
            old, old_id = f.read(), inode(state)
        at = rng.uniform(0, last_s) if kind == "moment" else None

        def saved(elapsed, old_id=old_id, at=at) -> bool:
            return inode(state) != old_id or (at is not None and elapsed >= at)

        run = run_killed(
            [*args, "--prompt-ids", prompt],
            tmp_path / f"run{i}",
            trigger=saved if kind != "save" else None,
            kill_at_rename=state if kind == "save" else None,
        )
        assert run.killed, f"{kind}: the run ended with {run.code} before it was killed: {run.stderr}"
        assert "Traceback" not in run.stderr, run.stderr
        if kind == "saved":
            last_s = run.seconds
        with open(state, "rb") as f:
            now = f.read()
        assert isinstance(json.loads(now), dict) and read_state(state, layout) is not None, now
        temporary = [e for e in os.listdir(os.path.dirname(state)) if e.endswith(".tmp")]
        if kind == "save":  # killed inside the save: its temporary file written, the state before kept
            assert now == old and temporary, (temporary, now[:80])
        if kind == "saved":
            assert now != old
        tally[f"{kind}: " + ("state before kept" if now == old else "new state")] += 1
        assert {e: digest(os.path.join(model, e)) for e in os.listdir(model) if e != ".weightstream"} == weights
    code, _, err = ran_in_process(*args, "--prompt-ids", "7,8")
    assert code == 0 and "Traceback" not in err, err
    assert "unreadable" not in err and "other expert files" not in err, err
    assert [e for e in os.listdir(os.path.dirname(state)) if e.endswith(".tmp")] == []  # a killed save's, removed
    assert read_state(state, layout) is not None
    print(f"\nwarm-restart save: {sum(tally.values())} kills, 0 lost or damaged: {dict(sorted(tally.items()))}")


# ------------------------------------------------------------------------------------------------------ disk full


def tensor_bytes(model: str) -> int:
    return sum(t.nbytes for t in open_checkpoint(model).tensors.values())


def disk_bytes(model: str) -> int:
    """What the directory takes on a tmpfs: each file in whole pages."""
    return sum(page_ceil(os.path.getsize(os.path.join(model, e))) for e in os.listdir(model))


@pytest.mark.parametrize("name", OPS)
def test_a_full_disk_is_a_clear_error_and_leaves_the_disk_as_it_was(operation, name, tmp_path):
    op = operation(name)
    data, whole = tensor_bytes(op.reference), disk_bytes(op.reference)
    assert whole > page_ceil(data) + 4 * 4096  # room between the two for the disk of the second case
    source = digest(op.source) if op.source else None
    # far too small: refused before any work
    with tmpfs(tmp_path / "small", 64 * 1024) as disk:
        out = os.path.join(disk, "out")
        code, _, err = ran_in_process(*op.args, "--out", out)
        assert_one_line_error(code, err, name, f"{out}: not enough space on {disk} (", " free, about ", " needed)")
        assert "nothing was written: free some space there or choose another --out" in err, err
        assert os.listdir(disk) == []
    # room for the tensors, not for the whole output: the write fails part way, and what it wrote is removed
    with tmpfs(tmp_path / "tight", page_ceil(data + (whole - data) // 2)) as disk:
        out = os.path.join(disk, "out")
        code, _, err = ran_in_process(*op.args, "--out", out)
        assert_one_line_error(code, err, name, f"{out}: no space left on {disk} while writing it (", " needed)")
        assert "the partial output is removed: free some space there or choose another --out" in err, err
        assert os.listdir(disk) == []
    # --force over an output already there, with no room for a second beside it: refused, the old one kept
    with tmpfs(tmp_path / "one", whole + 64 * 1024) as disk:
        out = os.path.join(disk, "out")
        code, _, err = ran_in_process(*op.args, "--out", out)
        assert code == 0, err
        kept = digest(out)
        code, _, err = ran_in_process(*op.args, "--out", out, "--force")
        assert_one_line_error(code, err, name, f"{out}: not enough space on {disk} (", "choose another --out")
        assert os.listdir(disk) == ["out"] and digest(out) == kept
    if op.source:
        assert digest(op.source) == source


def test_a_warm_restart_save_on_a_full_disk_is_said_and_keeps_the_state_before(tiny_model, tmp_path):
    with tmpfs(tmp_path / "disk", 8 * 2**20) as disk:
        model = os.path.join(disk, "model")
        shutil.copytree(tiny_model("qwen3_moe"), model, ignore=shutil.ignore_patterns(".weightstream"))
        state = state_path(model)
        args = ["generate", model, "--max-new-tokens", 4, "--warm-restart", "--no-o-direct", "--io-threads", 2]
        code, _, err = ran_in_process(*args, "--prompt-ids", "1,2,3")
        assert code == 0, err
        with open(state, "rb") as f:
            before = f.read()
        filler = fill(disk)
        code, _, err = ran_in_process(*args, "--prompt-ids", "9,10,11,12")
        assert code == 0 and "Traceback" not in err, err
        said = f"cannot save the expert cache's state to {state} (No space left on device); the next start reads the "
        assert said + "state saved before" in err, err
        with open(state, "rb") as f:
            assert f.read() == before
        assert sorted(os.listdir(os.path.dirname(state))) == [os.path.basename(state)]  # no temporary file
        os.unlink(filler)
