"""`--memory SIZE`: the engine measures its own footprint after load and a warm-up, keeps room for the KV cache and
gives the expert cache the rest; a SIZE too small is refused with one that works; a process given SIZE runs inside
a real memory cgroup of SIZE without being killed. And the warm restart: the cache's contents saved at exit, read
back at the next start, hottest first, within the budget."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from weightstream.cache.warm import read_state, state_path
from weightstream.engine.footprint import MEMORY_PREFILL_CHUNK, machine_memory, margin_for, size_cache, tensor_bytes
from weightstream.engine.loader import load_streaming_model
from weightstream.errors import WeightstreamError
from weightstream.io.pagecache import evict_file
from weightstream.units import MIB

from cgroup_support import cgroup_or_skip
from engine_support import greedy_run

PROMPT = torch.tensor([[3, 17, 101, 250, 7, 42, 311, 5]])
# experts of 6 MiB (bf16 3 x 512 x 2048), 32 a layer, 2 layers: 384 MiB of experts, more than an 800 MiB
# process has left after torch and transformers, so the cache --memory sizes is smaller than the experts
BIG_EXPERTS = dict(hidden_size=512, moe_intermediate_size=2048, num_experts=32, num_hidden_layers=2)


def test_memory_sizes_the_cache_from_the_measured_footprint(tiny_model):
    model_dir = tiny_model("qwen3_moe")
    want, _, _ = greedy_run(model_dir, PROMPT, expert_cache="100x")
    memory = 8 * 2**30
    model = load_streaming_model(model_dir, memory=memory, context=64, warmup_tokens=8)
    try:
        runtime = model.weightstream
        f = runtime.footprint
        assert f.memory == memory and f.context_tokens == 64 and f.warmup_tokens == 8
        assert f.libraries > 100 * MIB  # torch alone is more
        assert 0 < f.kv_cache < MIB and f.margin > 0
        assert f.runtime + f.expert_cache == memory
        assert runtime.cache.budget_bytes == f.expert_cache  # the cache is what is left (capped by the experts)
        with torch.inference_mode():
            got = model.generate(PROMPT, max_new_tokens=8, do_sample=False)[0].tolist()
        assert got == want
    finally:
        model.weightstream.close()
    # the dense weights as RSS growth, in a fresh process as a user's is: in this long-lived one, heap freed by
    # earlier tests can take them without the RSS growing (measured dense 0 in the full suite, once)
    code = (
        "import json, sys; from weightstream.engine.loader import load_streaming_model; "
        "m = load_streaming_model(sys.argv[1], memory=8 * 2**30, context=64, warmup_tokens=8); "
        "print(json.dumps(m.weightstream.footprint.to_dict())); m.weightstream.close()"
    )
    done = subprocess.run([sys.executable, "-c", code, model_dir], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    fresh = json.loads(done.stdout.strip().splitlines()[-1])
    assert fresh["dense"] > 0 and fresh["libraries"] > 100 * MIB


def test_a_memory_too_small_is_refused_with_a_size_that_works(tiny_model):
    model_dir = tiny_model("qwen3_moe")
    with pytest.raises(WeightstreamError, match=r"--memory 300\.0 MiB: too small for this model here") as err:
        load_streaming_model(model_dir, memory="300MiB", context=64, warmup_tokens=8)
    text = str(err.value)
    assert "libraries" in text and "one token's experts need" in text
    need = int(re.search(r"Give --memory (\d+)MiB or more", text).group(1))
    model = load_streaming_model(model_dir, memory=f"{need}MiB", context=64, warmup_tokens=8)
    try:
        assert model.weightstream.cache.budget_bytes >= model.weightstream.layout.working_set_bytes
    finally:
        model.weightstream.close()


def test_memory_reserves_a_16bit_latent_cache_at_half(tiny_model):
    """--kv-dtype float16 halves the KV cache --memory reserves for a DeepSeek model's context; a refusal of a float32
    latent cache names it."""
    model_dir = tiny_model("deepseek_v3")
    with pytest.raises(WeightstreamError, match=r"shorter context, or --kv-dtype float16: half the KV cache\)"):
        load_streaming_model(model_dir, memory="300MiB", context=64, warmup_tokens=8)
    reserved = {}
    for kv in ("auto", "float16"):
        model = load_streaming_model(model_dir, memory="4GiB", context=4096, warmup_tokens=8, kv_dtype=kv)
        try:
            reserved[kv] = model.weightstream.footprint.kv_cache
        finally:
            model.weightstream.close()
    layers = model.config.get_text_config().num_hidden_layers
    assert reserved["auto"] == layers * (32 + 8) * 4 * 4096 == 2 * reserved["float16"]


def test_memory_reserves_a_q8_0_latent_cache_at_its_blocks_bytes(tiny_model):
    """--kv-dtype q8_0: --memory reserves 34 bytes a 32 cached values (27% of float32's); a refusal of a float32 or a
    16-bit latent cache whose rows are whole blocks names q8_0 (a model whose rows are not: test above)."""
    model_dir = tiny_model("deepseek_v3", qk_rope_head_dim=32, head_dim=32)
    with pytest.raises(WeightstreamError, match=r"or --kv-dtype float16: half the KV cache \(q8_0: 27% of it\)\)"):
        load_streaming_model(model_dir, memory="300MiB", context=64, warmup_tokens=8)
    with pytest.raises(WeightstreamError, match=r"shorter context, or --kv-dtype q8_0: 53% of the KV cache\)"):
        load_streaming_model(model_dir, memory="300MiB", context=64, warmup_tokens=8, kv_dtype="float16")
    reserved = {}
    for kv in ("auto", "q8_0"):
        model = load_streaming_model(model_dir, memory="4GiB", context=4096, warmup_tokens=8, kv_dtype=kv)
        try:
            reserved[kv] = model.weightstream.footprint.kv_cache
            assert model.weightstream.kv_cache_bytes_per_token * 4096 == reserved[kv]
        finally:
            model.weightstream.close()
    layers = model.config.get_text_config().num_hidden_layers
    assert reserved["auto"] == layers * (32 + 32) * 4 * 4096 and reserved["q8_0"] == layers * 2 * 34 * 4096


def test_sizing_arithmetic_and_its_refusal():
    m = MIB
    common = dict(libraries=300 * m, steady=500 * m, peak=520 * m, cache_resident=50 * m, embedding=m)
    common.update(kv_cache=10 * m, context_tokens=8, warmup_tokens=4, working_set=100 * m)
    f = size_cache(2000 * m, **common)
    # dense = steady - cache pages - libraries; temporaries = peak above steady; the rest after KV and margin
    assert (f.dense, f.temporaries) == (150 * m, 20 * m)
    assert f.expert_cache == 2000 * m - 300 * m - 150 * m - 20 * m - 10 * m - f.margin
    with pytest.raises(WeightstreamError, match="Give --memory") as err:
        size_cache(500 * m, **common)
    need = int(re.search(r"Give --memory (\d+)MiB", str(err.value)).group(1)) * m
    assert size_cache(need, **common).expert_cache >= 100 * m  # the size it names is enough
    # pages reclaimed before the measurement: the dense weights count what their tensors span
    held = size_cache(2000 * m, **common, dense_tensors=400 * m)
    assert (held.dense, held.dense_tensors) == (400 * m, 400 * m) and held.expert_cache == f.expert_cache - 250 * m


def test_memory_goes_with_nothing_that_contradicts_it(tiny_model):
    model_dir = tiny_model("qwen3_moe")
    with pytest.raises(WeightstreamError, match="give one; --memory sizes the expert cache itself"):
        load_streaming_model(model_dir, memory="4GiB", expert_cache="2x")
    with pytest.raises(WeightstreamError, match="page-cache has none"):
        load_streaming_model(model_dir, memory="4GiB", expert_source="page-cache")
    with pytest.raises(WeightstreamError, match="more than this machine's"):
        load_streaming_model(model_dir, memory=machine_memory() + 2**30)
    with pytest.raises(WeightstreamError, match="--memory 'lots': not a size"):
        load_streaming_model(model_dir, memory="lots")
    r = subprocess.run(
        [sys.executable, "-m", "weightstream.cli", "generate", model_dir, "--prompt-ids", "1,2", "--memory", "2GiB"]
        + ["--expert-cache", "2x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "not allowed with argument" in r.stderr


def test_generate_with_memory_runs_inside_a_cgroup_of_that_size(tiny_model):
    """A real cgroup of SIZE around `generate --memory SIZE`: not killed, the cache is what the footprint left
    (less than the model's experts, so the size decided it), the tokens are the model's."""
    model_dir = tiny_model("qwen3_moe", "bf16", **BIG_EXPERTS)
    ids = "3,17,101,250,7,42,311,5"
    cli = [sys.executable, "-m", "weightstream.cli", "generate", model_dir, "--prompt-ids", ids]
    cli += ["--max-new-tokens", "8", "--json"]
    want = subprocess.run([*cli, "--expert-cache", "100x"], capture_output=True, text=True, timeout=300)
    assert want.returncode == 0, want.stderr
    limit = 800 * MIB
    group = cgroup_or_skip(limit)
    try:
        got = group.popen([*cli, "--memory", "800MiB"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = got.communicate(timeout=300)
        assert got.returncode == 0, err
        assert group.oom_kills in (0, None)
        report = json.loads(out)
        memory = report["stats"]["memory"]
        experts = 2 * 32 * 6 * MIB
        assert memory["memory"] == limit and 0 < memory["expert_cache"] < experts
        assert report["stats"]["expert_cache_bytes"] <= memory["expert_cache"]
        assert report["token_ids"] == json.loads(want.stdout)["token_ids"]
    finally:
        group.remove()


def test_the_size_a_refusal_names_runs_in_a_cgroup_of_that_size(tiny_model):
    """The dense weights count at least what their tensors span: measured in a cgroup too small for them, their file
    pages are reclaimed as the warm-up reads them, and the resident pages alone named a size that a cgroup of that
    size refused again, asking for more (this model: 800 MiB refused asking 999, 999 refused asking 1164; gpt-oss at
    16k positions: 1542 MiB asked, then 1715)."""
    big_head = dict(vocab_size=160000, hidden_size=2048, moe_intermediate_size=512, num_experts=16, num_hidden_layers=2)
    model_dir = tiny_model("qwen3_moe", "bf16", **big_head)  # a 625 MiB output head; 1.5 GB in all
    cli = [sys.executable, "-m", "weightstream.cli", "generate", model_dir, "--prompt-ids", "3,17,101,250"]
    cli += ["--max-new-tokens", "4", "--json"]
    asked = None
    for size in (800, "asked"):
        limit = (asked if size == "asked" else size) * MIB
        for name in os.listdir(model_dir):  # its pages charged to the cgroup that reads them, as a cold start's
            evict_file(os.path.join(model_dir, name))
        group = cgroup_or_skip(limit)
        try:
            run = group.popen([*cli, "--memory", f"{limit // MIB}MiB"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = run.communicate(timeout=300)
            assert group.oom_kills in (0, None)
        finally:
            group.remove()
        if size == 800:
            assert run.returncode == 2, err.decode()[-2000:]
            asked = int(re.search(rb"Give --memory (\d+)MiB or more", err).group(1))
        else:
            assert run.returncode == 0, err.decode()[-2000:]
            memory = json.loads(out)["stats"]["memory"]
            assert memory["memory"] == limit and memory["dense"] >= memory["dense_tensors"] > 625 * MIB


def test_tensor_bytes_counts_each_byte_once():
    base = torch.zeros(1024, dtype=torch.float32)
    views = [base, base[:256], base[512:], base.view(2, 512)[1]]  # all within base's 4 KiB
    other = torch.zeros(100, dtype=torch.bfloat16)
    assert tensor_bytes(views) == 4096 and tensor_bytes([*views, other]) == 4096 + 200
    assert tensor_bytes([*views, other], leave_out=base) == 200  # what lies inside base left out
    assert tensor_bytes([torch.empty(8, device="meta"), other]) == 200


def test_a_warm_restart_reads_back_the_hottest_experts(tiny_model, tmp_path, capfd):
    model_dir = tiny_model("qwen3_moe")
    path = state_path(model_dir)
    if os.path.exists(path):
        os.unlink(path)
    cold, _, runtime = greedy_run(model_dir, PROMPT, expert_cache="1.5x", io_threads=2, warm_restart=True)
    cold_misses = runtime.cache.stats.misses
    saved = read_state(path, runtime.layout)
    assert saved is not None
    keys, heat = saved
    assert set(keys) == set(runtime.cache.slot_of) and len(keys) == runtime.cache.n_slots
    assert [heat[k] for k in keys] == sorted(heat.values(), reverse=True) and heat[keys[0]] > 0

    warm, _, runtime = greedy_run(model_dir, PROMPT, expert_cache="1.5x", io_threads=2, warm_restart=True)
    stats = runtime.cache.stats
    assert warm == cold  # what the cache holds never changes the tokens
    assert stats.warm_issued == len(keys)
    assert stats.misses < cold_misses  # the experts of the last run were there before the first token

    with open(path, "w") as f:  # a damaged state starts cold, says so, and is replaced at exit
        f.write("{not json")
    again, _, _ = greedy_run(model_dir, PROMPT, expert_cache="1.5x", io_threads=2, warm_restart=True)
    assert again == cold and "is unreadable" in capfd.readouterr().err
    assert read_state(path, runtime.layout) is not None


def test_a_state_saved_for_other_files_is_not_applied(tiny_model, tmp_path, capfd):
    model_dir = tiny_model("qwen3_moe")
    greedy_run(model_dir, PROMPT, expert_cache="1.5x", io_threads=2, warm_restart=True)
    with open(state_path(model_dir)) as f:
        state = json.load(f)
    state["fingerprint"] = "0" * 32
    with open(state_path(model_dir), "w") as f:
        json.dump(state, f)
    _, _, runtime = greedy_run(model_dir, PROMPT, expert_cache="1.5x", io_threads=2, warm_restart=True)
    assert runtime.cache.stats.warm_issued == 0 and "saved for other expert files" in capfd.readouterr().err
    with pytest.raises(WeightstreamError, match="page-cache has none"):
        load_streaming_model(model_dir, expert_source="page-cache", warm_restart=True)


def test_serve_with_memory_keeps_room_for_its_kv_cache_budget(tiny_model):
    """The KV budget is reserved, and what a chunk late in the longest context it holds needs more; the warm-up is
    one prefill chunk, and the scheduler prefills in chunks that long."""
    from weightstream.serve.metrics import ServeMetrics
    from weightstream.serve.service import ModelService, ServeSettings

    settings = ServeSettings(tiny_model("qwen3_moe"), engine={"memory": "8GiB", "io_threads": 2}, kv_cache="64MiB")
    service = ModelService(settings, ServeMetrics())
    service.load()
    try:
        footprint = service.model.weightstream.footprint
        assert footprint.kv_cache == 64 * MIB and footprint.warmup_tokens == MEMORY_PREFILL_CHUNK
        assert footprint.context_tokens == service.max_model_len  # 64 MiB holds more than the tiny model's 512
        # one layer's keys and values (2 KV heads x 16 x 4 bytes x 2), repeated for 4 query heads: 2 of them
        assert footprint.context_temporaries == 2 * (2 * 2 * 16 * 4) * 512
        assert service.model.weightstream.cache.budget_bytes == footprint.expert_cache
        assert service.scheduler.prefill_chunk == MEMORY_PREFILL_CHUNK
    finally:
        service.close()


def test_serve_refuses_a_batch_larger_than_what_memory_measures():
    from weightstream.serve.service import ServeSettings

    with pytest.raises(WeightstreamError, match=r"--max-batch 300 with --memory: .* --max-batch 256 or less"):
        ServeSettings("m", engine={"memory": "1GiB"}, max_batch=300)
    assert ServeSettings("m", engine={"memory": "1GiB"}, max_batch=300, prefill_chunk=512).prefill_chunk == 512
    assert ServeSettings("m", max_batch=300).prefill_chunk is None  # no --memory: a prompt in one forward
    with pytest.raises(WeightstreamError, match="--prefill-chunk 0: must be at least 1 token"):
        ServeSettings("m", prefill_chunk=0)


# Many query heads sharing few KV heads (what a prompt's rows hold in attention grows with the heads, and a chunk late
# in the context repeats the keys and values for every query head) and 512 small experts a layer (192 MiB: more than a
# 900 MiB process has left for its cache, which a long prompt therefore fills)
LONG_PROMPT_MODEL = dict(
    hidden_size=512,
    num_attention_heads=32,
    head_dim=128,
    num_key_value_heads=8,
    moe_intermediate_size=32,
    num_experts=512,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    max_position_embeddings=8192,
)


def test_serve_with_memory_answers_a_long_prompt_inside_a_cgroup_of_that_size(tiny_model):
    """A prompt 16 times the warm-up's length through `serve --memory SIZE` in a real cgroup of SIZE: answered, not
    killed, the cgroup's peak within SIZE, and the server's own peak resident set within what its footprint gave
    the runtime and the cache, SIZE less the margin (834 MiB of 900; prefilled in one forward, as serve did before,
    this prompt took the process to 870 MiB); its tokens are `generate`'s under the same chunk."""
    import httpx

    from weightstream.engine.generate import generate
    from weightstream.engine.loader import load_tokenizer

    from serve_support import ServerProcess

    model_dir = tiny_model("qwen3_moe", **LONG_PROMPT_MODEL)
    limit = 900 * MIB
    ids = [(i * 7919 + 11) % 500 + 5 for i in range(16 * MEMORY_PREFILL_CHUNK)]
    group = cgroup_or_skip(limit)
    server = None
    try:
        args = ("--memory", "900MiB", "--kv-cache", "72MiB", "--io-threads", "2")
        server = ServerProcess(model_dir, *args, cgroup=group)
        server.wait_ready()
        body = {"model": "model", "prompt": ids, "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert server.proc.poll() is None, server.stderr
        peak_rss = _peak_rss(server.pid)
        cgroup_peak, oom_kills = group.peak_bytes, group.oom_kills
    finally:
        if server is not None:
            server.kill()
        group.remove()
    assert oom_kills in (0, None) and cgroup_peak <= limit
    assert peak_rss <= limit - margin_for(limit), (peak_rss / MIB, margin_for(limit) / MIB)
    model = load_streaming_model(model_dir, expert_cache="100x", io_threads=2)
    try:
        new, _ = generate(model, torch.tensor([ids]), 4, prefill_chunk=MEMORY_PREFILL_CHUNK)
    finally:
        model.weightstream.close()
    tokenizer = load_tokenizer(model_dir, required=True)
    assert r.json()["choices"][0]["text"] == tokenizer.decode(new[0].tolist(), skip_special_tokens=True)


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_settle_file_pages_marks_mappings_random_and_drops_their_unmapped_cached_pages(tmp_path):
    """What --memory does after its warm-up: a mapped file's pages that no mapping holds leave the page cache (they
    would be charged to the process's cgroup and crowd out what decode touches), the mapped page stays, and the
    mapping faults without readahead (VmFlags `rr`)."""
    import mmap

    from weightstream.engine.footprint import settle_file_pages
    from weightstream.io.pagecache import cached_bytes

    path = tmp_path / "weights.bin"
    page = mmap.PAGESIZE
    size = 32 * MIB
    path.write_bytes(os.urandom(size))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # clean pages, as a library's are: the kernel drops no dirty page on advice
        while os.read(fd, MIB):  # every page cached, read through the page cache, as imports read code
            pass
        assert cached_bytes(fd) == size
        mapped = mmap.mmap(fd, page, prot=mmap.PROT_READ)  # one page mapped and touched, as decode touches weights
        try:
            assert mapped[0] == path.read_bytes()[0]
            view = np.frombuffer(mapped, dtype=np.uint8)
            address = view.ctypes.data
            del view  # the mapping cannot close while a view of it lives
            assert "rr" not in _vm_flags(address)
            done = settle_file_pages()
            assert done["marked_bytes"] >= page and done["files_dropped"] >= 1
            assert "rr" in _vm_flags(address)
            # the mapped page stays, with the folio that holds it (ext4 caches in folios of up to 2 MiB)
            assert page <= cached_bytes(fd) <= 2 * MIB
        finally:
            mapped.close()
    finally:
        os.close(fd)
