"""The serving scheduler in process: batched greedy decode gives each request the tokens it gets alone (and alone,
the logits `generate` gives, bitwise); the KV budget makes requests wait; seeded sampling ignores the batch."""

import threading
import time

import pytest
import torch

from weightstream.engine.batching.batch import DecodeBatch
from weightstream.engine.batching.sampling import Sampler, SamplingParams
from weightstream.engine.batching.scheduler import ExpertCacheFit, Refused, Scheduler
from weightstream.engine.batching.sequence import Failed, Finished, Sequence
from weightstream.engine.batching.steps import StepRecorder
from weightstream.engine.batching.text import TextTail
from weightstream.engine.kv_cache import quiet_cache_kwarg
from weightstream.engine.loader import load_streaming_model, load_tokenizer

PROMPTS = [
    [3, 17, 101, 250, 7, 42, 311, 5],
    [9, 8, 7],
    [100, 200, 300, 400, 11],
    [5, 6],
    [44],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
]
NEW = 14


class Steps:
    """Scheduler observer: the batch size of every decode step."""

    def __init__(self):
        self.batches = []

    def prefilled(self, tokens, seconds, generated=1):
        pass

    def decoded(self, batch, seconds):
        self.batches.append(batch)

    def ended(self, seq, outcome):
        pass


def solo_greedy(model, prompt, new=NEW):
    """generate's greedy tokens and per-step logits, EOS ignored."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), [step[0] for step in out.logits]


def run(
    model,
    tokenizer,
    prompts,
    max_batch=8,
    params=None,
    kv_budget=1 << 30,
    kv_per_token=1024,
    record_logits=False,
    hooks=(),
    expert_fit=None,
):
    """Submit `prompts` a few ms apart (so they join a running batch at different steps); (tokens, logits, steps)."""
    steps = Steps()
    sched = Scheduler(model, max_batch, kv_budget, kv_per_token, hooks, observer=steps, expert_fit=expert_fit)
    sched.start()
    seqs, logits = [], []
    for prompt in prompts:
        seq = Sequence(prompt, params or SamplingParams(NEW, temperature=0.0), tokenizer, frozenset(), lambda e: None)
        if record_logits:
            rows, sample = [], seq.sampler
            seq.sampler = lambda x, rows=rows, sample=sample: rows.append(x.clone()) or sample(x)
            logits.append(rows)
        seqs.append(seq)
        sched.submit(seq)
        time.sleep(0.005)
    deadline = time.monotonic() + 120
    while not all(s.done for s in seqs) and time.monotonic() < deadline:
        time.sleep(0.01)
    sched.stop()
    assert all(s.finish_reason == "length" for s in seqs)
    return [s.generated for s in seqs], logits, steps.batches


@pytest.mark.parametrize(
    "arch, overrides, kv",
    [
        ("qwen3_moe", {}, "auto"),
        ("gpt_oss", {"sliding_window": 6}, "auto"),
        ("deepseek_v2", {}, "auto"),
        ("deepseek_v3", {}, "float16"),
    ],
)
def test_batched_greedy_equals_each_request_alone(tiny_model, arch, overrides, kv):
    """gpt_oss with a 6-token window pads and trims sliding layers; deepseek_v2 caches MLA's K and V shapes;
    deepseek_v3 with --kv-dtype float16 keeps its latent in float16 alone (generate's cache) and batched (the
    scheduler's, padded and joined): a float32 cache on either side would move the logits by some 1e-4."""
    model_dir = tiny_model(arch, **overrides)
    model = load_streaming_model(model_dir, expert_cache="2x", io_threads=2, kv_dtype=kv)
    tokenizer = load_tokenizer(model_dir, required=True)
    try:
        if kv != "auto":  # generate's own cache keeps the dtype asked
            with torch.inference_mode():
                out = model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=2, return_dict_in_generate=True)
            assert {layer.keys.dtype for layer in out.past_key_values.layers} == {getattr(torch, kv)}
        alone = [solo_greedy(model, p) for p in PROMPTS]
        tokens, logits, batches = run(model, tokenizer, PROMPTS, record_logits=True)
    finally:
        model.weightstream.close()
    assert tokens == [t for t, _ in alone]
    assert max(batches) >= 3, batches  # requests really decoded together
    # Batched, the dense matmuls run with more rows than alone and round differently: close, not bitwise. Measured:
    # at most 2.5e-7 on each of these models (logits up to 0.7: 4 float32 ulps); docs/serving.md says about 3e-7. A
    # float16 cache rounds those differences to its own ulps (2^-11 of a value) now and then: 7.2e-6 measured, where
    # a float32 cache on either side moves them by more than 1e-4
    worst = max(float((a - b).abs().max()) for got, (_, want) in zip(logits, alone) for a, b in zip(got, want))
    assert worst < (4e-7 if kv == "auto" else 3e-5), worst


def test_alone_the_scheduler_gives_generates_logits_bitwise(tiny_model):
    model_dir = tiny_model("olmoe")
    model = load_streaming_model(model_dir, expert_cache="1x", io_threads=2)
    tokenizer = load_tokenizer(model_dir, required=True)
    try:
        alone = [solo_greedy(model, p) for p in PROMPTS[:3]]
        tokens, logits, batches = run(model, tokenizer, PROMPTS[:3], max_batch=1, record_logits=True)
    finally:
        model.weightstream.close()
    assert set(batches) == {1}
    for got_tokens, got, (want_tokens, want) in zip(tokens, logits, alone):
        assert got_tokens == want_tokens
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_chunked_prefill_gives_generates_logits_under_the_same_chunk(tiny_model):
    """serve --memory prefills in chunks: alone, a request gets bitwise the logits of `generate` given the same chunk
    (prompts of 2 chunks and a bit, of exactly 2, and shorter than one). Unchunked, a prefill can round otherwise
    in the last bits (attention's blocking follows the rows of a forward), which is why generate takes the chunk."""
    model_dir = tiny_model("qwen3_moe")
    model = load_streaming_model(model_dir, expert_cache="2x", io_threads=2)
    tokenizer = load_tokenizer(model_dir, required=True)
    prompts = [PROMPTS[0] * 2 + PROMPTS[1], PROMPTS[0] * 2, PROMPTS[1]]
    sched = Scheduler(model, 1, 1 << 30, 1024, observer=Steps(), prefill_chunk=8)
    try:
        want = [_generate_logits(model, p, prefill_chunk=8) for p in prompts]
        got = []
        for prompt in prompts:
            seq = Sequence(prompt, SamplingParams(NEW, temperature=0.0), tokenizer, frozenset(), lambda e: None)
            rows, sample = [], seq.sampler
            seq.sampler = lambda x, rows=rows, sample=sample: rows.append(x.clone()) or sample(x)
            got.append((seq, rows))
        sched.start()
        for seq, _ in got:
            sched.submit(seq)
        _wait(lambda: all(seq.done for seq, _ in got))
    finally:
        sched.stop()
        model.weightstream.close()
    for (seq, rows), (tokens, logits) in zip(got, want):
        assert seq.generated == tokens
        assert len(rows) == len(logits) and all(torch.equal(a, b) for a, b in zip(rows, logits))


def _generate_logits(model, prompt, prefill_chunk=None):
    """`generate`'s (the engine's) greedy tokens and the logits each was picked from, EOS ignored."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from weightstream.engine.generate import generate

    logits = []

    class Keep(LogitsProcessor):
        def __call__(self, input_ids, scores):
            logits.append(scores[0].clone())
            return scores

    new, _ = generate(
        model,
        torch.tensor([prompt]),
        NEW,
        prefill_chunk=prefill_chunk,
        eos_token_id=None,
        logits_processor=LogitsProcessorList([Keep()]),
    )
    return new[0].tolist(), logits


def test_kv_budget_makes_requests_wait_and_all_finish(tiny_model):
    """A budget for two padded rows of the longest reservation: the batch's KV bytes never exceed it, never more
    than two sequences run, and every request finishes with its solo tokens."""
    model_dir = tiny_model("qwen3_moe")
    model = load_streaming_model(model_dir, expert_cache="2x", io_threads=2)
    tokenizer = load_tokenizer(model_dir, required=True)
    per_token = _kv_bytes_per_token(model)
    budget = 2 * (max(len(p) for p in PROMPTS) + NEW) * per_token
    peak = []
    sched = Scheduler(model, 8, budget, per_token)

    class Watch(Steps):
        def decoded(self, batch, seconds):
            super().decoded(batch, seconds)
            peak.append(sched.batch.kv_bytes())

    sched.observer = Watch()
    try:
        alone = [solo_greedy(model, p)[0] for p in PROMPTS]
        seqs = [Sequence(p, SamplingParams(NEW, 0.0), tokenizer, frozenset(), lambda e: None) for p in PROMPTS]
        sched.start()
        for seq in seqs:
            sched.submit(seq)
        _wait(lambda: all(s.done for s in seqs))
        with pytest.raises(Refused, match="larger --kv-cache"):
            sched.check_fits(budget // per_token + 1)
    finally:
        sched.stop()
        model.weightstream.close()
    assert [s.generated for s in seqs] == alone
    assert max(sched.observer.batches) == 2 and 0 < max(peak) <= budget


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny_model):
    model_dir = tiny_model("qwen3_moe")
    model = load_streaming_model(model_dir, expert_cache="2x", io_threads=2)
    tokenizer = load_tokenizer(model_dir, required=True)
    params = SamplingParams(NEW, temperature=0.9, top_p=0.8, seed=1234)
    try:
        alone, _, _ = run(model, tokenizer, PROMPTS[:1], params=params)
        batched, _, batches = run(model, tokenizer, PROMPTS[1:4] + PROMPTS[:1], params=params)
        other_seed, _, _ = run(model, tokenizer, PROMPTS[:1], params=SamplingParams(NEW, 0.9, 0.8, seed=99))
    finally:
        model.weightstream.close()
    assert batched[-1] == alone[0] and max(batches) > 1
    assert other_seed[0] != alone[0]


def test_a_cancelled_sequence_leaves_and_the_others_are_unaffected(tiny_model):
    model_dir = tiny_model("qwen3_moe")
    model = load_streaming_model(model_dir, expert_cache="2x", io_threads=2)
    tokenizer = load_tokenizer(model_dir, required=True)
    events = []
    sched = Scheduler(model, 8, 1 << 30, 1024)
    try:
        want = solo_greedy(model, PROMPTS[1], new=40)[0]
        long = Sequence(PROMPTS[-1], SamplingParams(400, 0.0), tokenizer, frozenset(), events.append)
        short = Sequence(PROMPTS[1], SamplingParams(40, 0.0), tokenizer, frozenset(), lambda e: None)
        sched.start()
        sched.submit(long)
        sched.submit(short)
        _wait(lambda: sched.running == 2)
        n = len(events)
        long.cancel()
        _wait(lambda: long.done)
        _wait(lambda: short.done)
    finally:
        sched.stop()
        model.weightstream.close()
    assert short.generated == want and len(long.generated) < 400
    assert len(events) <= n + 1 and not any(isinstance(e, Finished) for e in events)  # nothing after the cancel


def test_a_row_whose_sampling_fails_ends_alone(tiny_model):
    """A failure while picking one row's token (as NaN logits once made torch.multinomial raise) fails that request
    (500) and no other: the rows decoded with it get their solo tokens (issue 31)."""
    model_dir = tiny_model("qwen3_moe")
    model = load_streaming_model(model_dir, expert_cache="2x", io_threads=2)
    tokenizer = load_tokenizer(model_dir, required=True)
    events = []
    sched = Scheduler(model, 8, 1 << 30, 1024, observer=Steps())
    try:
        want = [solo_greedy(model, p)[0] for p in PROMPTS[:3]]
        seqs = [Sequence(p, SamplingParams(NEW, 0.0), tokenizer, frozenset(), lambda e: None) for p in PROMPTS[:3]]
        broken = Sequence(PROMPTS[3], SamplingParams(NEW, 0.0), tokenizer, frozenset(), events.append)
        sample = broken.sampler

        def fails_at_the_fourth_token(logits):
            if len(broken.generated) == 3:
                raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
            return sample(logits)

        broken.sampler = fails_at_the_fourth_token
        for seq in [seqs[0], broken, *seqs[1:]]:
            sched.submit(seq)
        sched.start()
        _wait(lambda: all(s.done for s in seqs) and broken.done)
    finally:
        sched.stop()
        model.weightstream.close()
    assert [s.generated for s in seqs] == want
    assert all(s.finish_reason == "length" for s in seqs)
    assert len(broken.generated) == 3 and isinstance(events[-1], Failed) and events[-1].status == 500
    assert "probability tensor" in events[-1].message
    assert min(sched.observer.batches) == 3 and max(sched.observer.batches) == 4  # it failed in a batch of four


def test_the_newest_sequence_gives_way_when_the_batch_outgrows_the_kv_budget(tiny_model):
    """Reservations grow with the sequences: a short request joins a long one that reserved little so far; when
    the padded batch would outgrow the budget, the newest is preempted (its KV dropped), waits at the head of the
    queue, and is prefilled again with its prompt and tokens so far once there is room. Both get their solo
    tokens, and the batch's KV never exceeds the budget."""
    model_dir = tiny_model("qwen3_moe")
    model = load_streaming_model(model_dir, expert_cache="2x", io_threads=2)
    tokenizer = load_tokenizer(model_dir, required=True)
    per_token = _kv_bytes_per_token(model)
    budget = 60 * per_token
    peak = []
    sched = Scheduler(model, 8, budget, per_token, kv_headroom=4)

    class Watch(Steps):
        def decoded(self, batch, seconds):
            super().decoded(batch, seconds)
            peak.append(sched.batch.kv_bytes())

    sched.observer = Watch()
    try:
        want = [solo_greedy(model, PROMPTS[-1], new=45)[0], solo_greedy(model, PROMPTS[1], new=40)[0]]
        long = Sequence(PROMPTS[-1], SamplingParams(45, 0.0), tokenizer, frozenset(), lambda e: None)  # 56 positions
        short = Sequence(PROMPTS[1], SamplingParams(40, 0.0), tokenizer, frozenset(), lambda e: None)  # 43
        sched.submit(long)
        sched.submit(short)  # with whole reservations (56 + 43) x 2 rows they could never run together
        sched.start()
        _wait(lambda: long.done and short.done)
    finally:
        sched.stop()
        model.weightstream.close()
    assert [long.generated, short.generated] == want
    assert long.finish_reason == short.finish_reason == "length"
    assert max(sched.observer.batches) == 2 and sched.preemptions == 1
    assert max(peak) <= budget


def test_sampling_is_numerically_safe_and_applies_bias_and_penalties_per_row():
    """Temperatures whose logits / T overflow float32 sample as greedy (below 1e-5); others subtract the max first,
    so nothing overflows to NaN. Bias and penalties change this sampler's scores only, never the logits passed in."""
    logits = torch.tensor([3.0, 1.0, 3.0 - 1e-6, -2.0, 0.5])
    for temperature in (1.5e-39, 1e-30, 9e-6):
        assert Sampler(SamplingParams(4, temperature, seed=1))(logits) == 0
    huge = torch.tensor([1e38, -1e38, 1e38, 0.0])
    for temperature in (1e-5, 1e-3, 0.5, 2.0):  # sampled: (logits - max) / T never overflows to +inf or NaN
        assert Sampler(SamplingParams(4, temperature, top_p=0.9, seed=2))(huge) in (0, 2)
    row = logits.clone()
    biased = Sampler(SamplingParams(4, 0.0, logit_bias=((4, 100.0), (0, -100.0))))
    assert biased(row) == 4 and torch.equal(row, logits)
    penalised = Sampler(SamplingParams(4, 0.0, presence_penalty=0.5, frequency_penalty=0.4))
    picks = [penalised(row) for _ in range(4)]
    assert torch.equal(row, logits)
    # 3.0 wins, then 3.0 - 1e-6, then 3.0 - 0.9 = 2.1 (presence 0.5 + one count x 0.4) against 2.1 - 1e-6: 0 again
    assert picks == [0, 2, 0, 2]


def test_leaving_rows_take_their_padding_with_them(tiny_model):
    """The longest row leaves: columns that only it used go, so the batch is as long as its longest sequence."""
    from transformers.cache_utils import DynamicCache

    model = load_streaming_model(tiny_model("gpt_oss", sliding_window=6), expert_cache="2x", io_threads=2)
    batch = DecodeBatch()
    try:
        for prompt in (PROMPTS[-1], PROMPTS[1], PROMPTS[4]):  # 11, 3 and 1 tokens
            cache = DynamicCache(config=model.config)
            with torch.inference_mode(), quiet_cache_kwarg():
                model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
            seq = Sequence(prompt, SamplingParams(8, 0.0), None, frozenset(), lambda e: None)
            seq.generated = [7]
            batch.join(seq, cache)
        for _ in range(2):
            with torch.inference_mode(), quiet_cache_kwarg():
                model(**batch.step_inputs(), use_cache=True)
        assert batch.length == 13 and batch.mask.sum(dim=1).tolist() == [13, 5, 3]
        batch.leave({batch.seqs[0].id})
    finally:
        model.weightstream.close()
    assert batch.length == 5 and batch.mask.sum(dim=1).tolist() == [5, 3]
    stored = sorted({layer.keys.shape[-2] for layer in batch.cache.layers})
    assert stored == [5]  # full layers: 5 positions; sliding layers (window 6) keep up to 5 as well


def _wait(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_stop_strings_never_reach_the_stream(tiny_model):
    """Released pieces concatenate to the final text, which ends before the first stop string."""
    tokenizer = load_tokenizer(tiny_model("qwen3_moe"), required=True)
    ids = tokenizer("The answer is 42. Hello, world! Paris is the capital").input_ids
    tail = TextTail(tokenizer, ("world", "Paris"))
    pieces, stopped = [], False
    for n in range(1, len(ids) + 1):
        piece, stopped = tail.push(ids[:n])
        pieces.append(piece)
        if stopped:
            break
    pieces.append(tail.finish())
    assert stopped and "".join(pieces) == "The answer is 42. Hello, "


def test_empty_batch_and_join_shapes():
    """Two sequences of 5 and 3 positions join: the shorter is padded on the left (mask 0, zero K/V) and its own
    K/V sit right-aligned; a step gives each row its own position; when the longer row leaves, the columns only it
    used go with it."""
    from transformers.cache_utils import DynamicCache

    batch = DecodeBatch()
    assert len(batch) == 0 and batch.length == 0 and batch.kv_bytes() == 0
    heads, dim, layers = 2, 4, 2
    kv = {5: torch.randn(1, heads, 5, dim), 3: torch.randn(1, heads, 3, dim)}
    seqs = []
    for n in (5, 3):
        cache = DynamicCache()
        for layer in range(layers):
            cache.update(kv[n] + layer, -kv[n], layer)
        seq = Sequence(list(range(1, n + 1)), SamplingParams(8, 0.0), None, frozenset(), lambda e: None)
        seq.generated = [40 + n]
        batch.join(seq, cache)
        seqs.append(seq)
    assert len(batch) == 2 and batch.length == 5
    assert batch.mask.tolist() == [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]
    for layer, stored in enumerate(batch.cache.layers):
        assert stored.keys.shape == stored.values.shape == (2, heads, 5, dim)
        assert torch.equal(stored.keys[0], kv[5][0] + layer) and torch.equal(stored.values[0], -kv[5][0])
        assert torch.equal(stored.keys[1, :, 2:], kv[3][0] + layer) and not stored.keys[1, :, :2].any()
    assert batch.kv_bytes() == layers * 2 * (2 * heads * 5 * dim) * 4

    inputs = batch.step_inputs()
    assert inputs["input_ids"].tolist() == [[45], [43]] and inputs["position_ids"].tolist() == [[5], [3]]
    assert inputs["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]]
    step = torch.randn(2, heads, 1, dim)
    for layer in range(layers):
        batch.cache.update(step, step, layer)  # what the model's forward appends: one position per row
    assert batch.cache.layers[0].keys.shape == (2, heads, 6, dim)

    batch.leave({seqs[0].id})
    assert batch.seqs == [seqs[1]] and batch.length == 4 and batch.mask.tolist() == [[1, 1, 1, 1]]
    for layer, stored in enumerate(batch.cache.layers):
        assert stored.keys.shape == stored.values.shape == (1, heads, 4, dim)
        assert torch.equal(stored.keys[0, :, :3], kv[3][0] + layer) and torch.equal(stored.keys[0, :, 3:], step[1])


def test_scheduler_threads_end(tiny_model):
    model = load_streaming_model(tiny_model("qwen3_moe"), expert_cache="2x", io_threads=2)
    sched = Scheduler(model, 4, 1 << 20, 1024)
    sched.start()
    sched.stop()
    model.weightstream.close()
    assert not any(t.name in ("ws-scheduler",) or t.name.startswith("ws-io-") for t in threading.enumerate())


def test_batched_replay_gives_each_sequence_its_own_part_of_the_trace(tiny_model):
    """Three sequences decoding together replay trace requests 0, 1, 0 from their starts, token after token."""
    from weightstream.engine.routing import BatchRoutingReplay
    from weightstream.trace.remap import token_rows

    from _real_traces import mixtral

    trace = mixtral(("gsm8k_2_routing.jsonl",))
    model_dir = tiny_model("mixtral")
    model = load_streaming_model(model_dir, expert_cache="2x", io_threads=2)
    tokenizer = load_tokenizer(model_dir, required=True)
    runtime = model.weightstream
    replay = BatchRoutingReplay(trace, runtime.layout)
    seen: dict[int, list] = {}

    class Capture:
        def begin_step(self, seq_ids, tokens, phase):
            self.owners = [s for s, n in zip(seq_ids, tokens) for _ in range(n)]

        def __call__(self, layer, top_k_index, top_k_weights):
            if layer == runtime.layout.layers[0]:
                for owner, row in zip(self.owners, top_k_index.tolist()):
                    seen.setdefault(owner, []).append(row)

        def end_step(self, seconds):
            pass

        def end_sequence(self, seq_id):
            pass

    capture = Capture()
    runtime.routing_override, runtime.routing_observer = replay, capture
    sched = Scheduler(model, 8, 1 << 30, 1024, hooks=[replay, capture], observer=Steps())
    seqs = [Sequence(p, SamplingParams(10, 0.0), tokenizer, frozenset(), lambda e: None) for p in PROMPTS[:3]]
    try:
        sched.start()
        for seq in seqs:
            sched.submit(seq)
        _wait(lambda: all(s.done for s in seqs))
    finally:
        sched.stop()
        model.weightstream.close()
    assert max(sched.observer.batches) > 1
    choices = token_rows(trace)[:, 0]  # (tokens, top-k) at the first routed layer
    for seq, request in zip(seqs, (0, 1, 0)):
        start = replay.request_starts[request]
        n = len(seq.prompt_ids) + len(seq.generated) - 1  # the last token is sampled, never run
        assert seen[seq.id] == choices[start : start + n].tolist()
    assert replay.cursors == {}  # every sequence's cursor was dropped when it ended


def test_expert_cache_fit_arithmetic():
    """rows x per-row experts x the union measured below `rows`, against the slots."""
    measured = {1: 1.0, 2: 0.75, 3: 0.6}
    fit = ExpertCacheFit(256, 128, lambda b: measured[min(b, 3)])
    assert fit(1) and fit(2)  # 2 x 128 x 1.0 = 256
    assert not fit(3)  # 3 x 128 x 0.75 = 288
    assert fit.largest(8) == 2 and fit.largest(1) == 1
    assert ExpertCacheFit(191, 128, lambda b: 1.0).largest(8) == 1


@pytest.mark.parametrize("cache, most", [("1.5x", 1), ("2x", 2)])
def test_batches_grow_only_while_their_experts_fit_the_cache(tiny_model, cache, most):
    """A 1.5x cache cannot hold two rows' experts, so the requests decode one at a time; 2x holds two rows before
    any union is measured. Tokens are each request's own either way."""
    model_dir = tiny_model("qwen3_moe")
    model = load_streaming_model(model_dir, expert_cache=cache, io_threads=2)
    tokenizer = load_tokenizer(model_dir, required=True)
    runtime = model.weightstream

    class Routing:
        """Routing observer and hook: keeps every step's choices per layer, and passes them to the recorder."""

        def __init__(self, recorder):
            self.recorder, self.steps = recorder, []

        def begin_step(self, seq_ids, tokens, phase):
            self.steps.append((phase, len(seq_ids), []))

        def __call__(self, layer, top_k_index, top_k_weights):
            self.steps[-1][2].append(top_k_index.clone())
            self.recorder(layer, top_k_index, top_k_weights)

        def end_step(self, seconds):
            pass

        def end_sequence(self, seq_id):
            pass

    try:
        alone = [solo_greedy(model, p)[0] for p in PROMPTS]
        recorder = StepRecorder(runtime)
        routing = Routing(recorder)
        runtime.routing_observer = routing
        per_row = runtime.layout.top_k * len(runtime.layout.num_experts)
        fit = ExpertCacheFit(runtime.cache.n_slots, per_row, recorder.union_ratio)
        tokens, _, batches = run(model, tokenizer, PROMPTS, hooks=[recorder, routing], expert_fit=fit)
    finally:
        runtime.routing_observer = None
        model.weightstream.close()
    assert tokens == alone
    assert max(batches) <= most, batches
    if most > 1:
        assert max(batches) == most, batches  # it does batch as far as the cache allows
        # the ratio the fit used: distinct experts / choices over the decode steps of `most` rows, from the routing
        steps = [layers for phase, rows, layers in routing.steps if phase == "decode" and rows == most]
        distinct = sum(len(set(index.flatten().tolist())) for layers in steps for index in layers)
        choices = sum(index.numel() for layers in steps for index in layers)
        assert choices == len(steps) * len(runtime.layout.num_experts) * most * runtime.layout.top_k > 0
        assert recorder.union_ratio(most) == distinct / choices < 1  # two rows shared experts


def _kv_bytes_per_token(model) -> int:
    """KV bytes one position takes in this model's cache (one forward of one token)."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode(), quiet_cache_kwarg():
        model(input_ids=torch.tensor([[1]]), past_key_values=cache, use_cache=True)
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
