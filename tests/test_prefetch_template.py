"""Templates: identity and fingerprint checks, and the size of a real recorded template."""

from __future__ import annotations

import json
import os

import pytest

from weightstream.prefetch.template import FileIdentity, LoadTemplate, TemplateError, WorkerTemplate

from prefetch_support import cli, drop, loader, tracefs_ok

GIB = 1 << 30


def test_identity_detects_each_kind_of_change(tmp_path):
    path = tmp_path / "w.safetensors"
    path.write_bytes(os.urandom(3 << 20))
    ident = FileIdentity.of(str(path))
    assert ident.mismatch() is None
    st = path.stat()
    with open(path, "r+b") as f:  # a byte in the middle sample, same size, mtime put back
        f.seek(ident.size * 4 // 9)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert "content fingerprint differs" in ident.mismatch()
    path.write_bytes(os.urandom(1 << 20))
    assert "size" in ident.mismatch()
    path.unlink()
    assert "is gone" in ident.mismatch()


def test_template_json_roundtrip_and_corruption(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(b"x" * 10000)
    t = LoadTemplate(
        {"model": "m"}, "k", [FileIdentity.of(str(path))], [WorkerTemplate("p", [(0, 0, 8192)])], "tracefs", 1.5
    )
    back = LoadTemplate.from_json(t.to_json())
    assert back == t and back.check_ranges() is None
    for bad in ("", "{", '{"format": "other"}', t.to_json().replace('"ranges":"', '"ranges":"!!')):
        with pytest.raises(TemplateError):
            LoadTemplate.from_json(bad)
    t.workers[0].ranges.append((0, 16384, 4096))
    assert "points past the end" in t.check_ranges()


@pytest.mark.skipif(not tracefs_ok(), reason="needs root and tracefs")
def test_recorded_template_is_under_1_kib_per_gib(tmp_path):
    model = tmp_path / "big"
    model.mkdir()
    path = model / "model.safetensors"
    with open(path, "wb") as f:  # 1 GiB, sparse: reading it costs page cache, not disk
        f.write(os.urandom(1 << 20))
        f.truncate(GIB)
    drop([str(path)])
    try:
        rec = cli(
            tmp_path / "home",
            "prefetch",
            "record",
            "--spec",
            "model=big",
            "--model-dir",
            str(model),
            "--",
            *loader("read", [str(path)]),
            timeout=300,
        )
        assert rec.returncode == 0, rec.stderr.decode()
        (template,) = (tmp_path / "home" / "templates").glob("*.json")
        assert LoadTemplate.from_json(template.read_text()).bytes >= GIB - (1 << 20)
        assert template.stat().st_size < 1024
    finally:
        drop([str(path)])
        path.unlink()


def test_held_files_mark_only_their_chunks_and_old_templates_keep_every_file():
    from weightstream.prefetch.plan import Plan

    files = [FileIdentity(f"/m/{i}.safetensors", 8 << 20, 0, 1, i, "x") for i in range(2)]
    ranges = [(0, 0, 8 << 20), (1, 0, 8 << 20)]
    one = LoadTemplate({}, "k", files, [WorkerTemplate("p", ranges, 1.0, True, [1])], "tracefs", 0.0)
    back = LoadTemplate.from_json(one.to_json())
    assert back.workers[0].held_files == [1]
    plan = Plan.from_template(back)
    assert plan.no_burn == [False] and {c.file for c in plan.workers[0] if c.shared} == {1}
    doc = json.loads(one.to_json())
    del doc["workers"][0]["held_files"]  # written before held_files existed: all files count as held
    assert Plan.from_template(LoadTemplate.from_json(json.dumps(doc))).no_burn == [True]
    doc["workers"][0]["held_files"] = [5]
    with pytest.raises(TemplateError, match="held_files"):
        LoadTemplate.from_json(json.dumps(doc))
