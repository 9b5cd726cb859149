"""`weightstream serve` as OpenAI clients use it beyond one sampled text: logprobs (completions' top-N with echo,
chat's top_logprobs), n choices, lists of prompts, streamed logprobs, and chat on a synthesized checkpoint (synth
writes a chat template). One server for the module on the tiny fp32 qwen3_moe exactly as `synthesize` writes it.

Exactness: every logprob the server reports is compared with log_softmax of one plain forward of the same model
over prompt + completion (loaded here as `weightstream generate` loads it). The server gets its logprobs from a
prefill and decode steps with a KV cache instead; on this fp32 model the two agree to about 1e-6 (float32 at
logprobs near -6): the tests hold them to TOL = 1e-5.
"""

import json
import threading
import time

import httpx
import openai
import pytest
import torch

from weightstream.engine.batching.sampling import SamplingParams
from weightstream.engine.batching.scheduler import Scheduler
from weightstream.engine.batching.sequence import Finished, PromptScored, Sequence
from weightstream.engine.generate import generate

from serve_support import loaded, metric, serving

NAME = "model"
TOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("qwen3_moe")


@pytest.fixture(scope="module")
def server(model_dir):
    with serving(model_dir, "--max-batch", "8", "--expert-cache", "2x", "--io-threads", "2") as server:
        yield server


@pytest.fixture(scope="module")
def engine(model_dir):
    with loaded(model_dir, expert_cache="2x", io_threads=2) as both:
        yield both


def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0)


def forward_logprobs(engine, ids):
    """(len(ids), V): row i is log_softmax of the logits after ids[: i + 1], from one forward without a cache."""
    model, _ = engine
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def greedy_ids(engine, ids, n):
    new, _ = generate(engine[0], torch.tensor([ids]), n)
    return new[0].tolist()


def shown(tokenizer, token):
    """How the server shows a token, where that is plain: its text decoded alone (None for part of a character)."""
    text = tokenizer.decode([token], skip_special_tokens=False)
    return None if "\ufffd" in text else text


def check_token(tokenizer, got, token):
    want = shown(tokenizer, token)
    assert got == want if want is not None else got.startswith("bytes:"), (got, token)


def check_completion_logprobs(engine, lp, ids, first, top):
    """`lp` (a completions logprobs object) scores ids[first:] as the forward does, with each row's `top`."""
    _, tokenizer = engine
    ref = forward_logprobs(engine, ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids) - first
    for k, token in enumerate(ids[first:]):
        i = first + k
        check_token(tokenizer, lp.tokens[k], token)
        if i == 0:  # an echoed prompt's first token: nothing precedes it
            assert lp.token_logprobs[k] is None and lp.top_logprobs[k] is None
            continue
        assert abs(lp.token_logprobs[k] - ref[i - 1, token].item()) < TOL, (k, lp.token_logprobs[k])
        values, best = ref[i - 1].topk(top)
        want = {shown(tokenizer, t): v for t, v in zip(best.tolist(), values.tolist()) if shown(tokenizer, t)}
        got = lp.top_logprobs[k]
        assert len(got) in (top, top + 1) and lp.tokens[k] in got  # the N best, and always the token itself
        for text, value in want.items():
            assert abs(got[text] - value) < TOL, (k, text)


def check_offsets(text, lp):
    """text_offset[i] is where token i starts in the choice's text (checked where the text before it is whole)."""
    offsets = lp.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(text)
    for token, at in zip(lp.tokens, offsets):
        if not token.startswith("bytes:") and "\ufffd" not in text[:at] + token and token not in ("<|eos|>",):
            assert text[at : at + len(token)] == token, (text, token, at)


def test_chat_on_a_synthesized_model(server, engine):
    """`make demo` then `weightstream serve` then a chat: synth writes a ChatML-shaped template on its own special
    tokens, so chat answers 200 with an assistant message, prompted as the template renders the messages."""
    _, tokenizer = engine
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital?"}]
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": NAME, "messages": messages, "max_tokens": 6, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|>system\nBe brief.<|eos|>\n<|bos|>user\nWhat is the capital?<|eos|>\n<|bos|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    assert message["content"] == tokenizer.decode(greedy_ids(engine, ids, 6), skip_special_tokens=True)
    got = client(server).chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0)
    assert got.choices[0].message.content == message["content"]


def test_completion_logprobs_equal_a_plain_forward(server, engine):
    """logprobs=5: each generated token's logprob and its row's five best equal the forward's; the greedy tokens are
    those of the same request without logprobs, and of `generate`."""
    _, tokenizer = engine
    c = client(server)
    prompt = "The quick brown fox"
    ids = tokenizer(prompt).input_ids
    new = greedy_ids(engine, ids, 8)
    plain = c.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0)
    got = c.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0, logprobs=5)
    choice = got.choices[0]
    assert choice.text == plain.choices[0].text == tokenizer.decode(new, skip_special_tokens=True)
    assert plain.choices[0].logprobs is None
    check_completion_logprobs(engine, choice.logprobs, ids + new, len(ids), 5)
    check_offsets(choice.text, choice.logprobs)
    zero = c.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0, logprobs=0)
    assert [len(t) for t in zero.choices[0].logprobs.top_logprobs] == [1, 1, 1]  # the token's own only


def test_echo_scores_the_prompt_as_lm_eval_asks(server, engine):
    """lm-eval's loglikelihood call, max_tokens=0 with echo and logprobs=1: the prompt back, each of its tokens scored
    (the first with null, as OpenAI returns it), no token generated. And echo with a completion after it."""
    _, tokenizer = engine
    context, continuation = "What is the capital of France?", " Paris is the capital"
    ids = tokenizer(context + continuation).input_ids
    c = client(server)
    for prompt in (context + continuation, ids, [ids]):  # a string, token ids, a one-element list of them
        got = c.completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
        choice = got.choices[0]
        assert choice.text == context + continuation and choice.finish_reason == "length"
        assert got.usage.completion_tokens == 0 and got.usage.prompt_tokens == len(ids)
        check_completion_logprobs(engine, choice.logprobs, ids, 0, 1)
        check_offsets(choice.text, choice.logprobs)
    new = greedy_ids(engine, ids, 4)
    greedy = c.completions.create(
        model=NAME, prompt=context + continuation, max_tokens=4, echo=True, logprobs=5, temperature=0
    )
    assert greedy.choices[0].text == context + continuation + tokenizer.decode(new, skip_special_tokens=True)
    check_completion_logprobs(engine, greedy.choices[0].logprobs, ids + new, 0, 5)
    check_offsets(greedy.choices[0].text, greedy.choices[0].logprobs)
    echoed = c.completions.create(model=NAME, prompt=context, max_tokens=2, echo=True, temperature=0)
    assert echoed.choices[0].text.startswith(context) and echoed.choices[0].logprobs is None


def test_n_choices_and_lists_of_prompts(server, engine):
    """n=3 greedy: three identical choices; n=3 seeded: three distinct ones, the same again for the same seed, the
    first equal to n=1 with that seed; two prompts x n=2: four choices, prompt-major, each its prompt's own."""
    _, tokenizer = engine
    c = client(server)
    greedy = c.completions.create(model=NAME, prompt="Paris", max_tokens=6, temperature=0, n=3, logprobs=2)
    assert [ch.index for ch in greedy.choices] == [0, 1, 2]
    assert len({ch.text for ch in greedy.choices}) == 1
    assert greedy.usage.completion_tokens == 18 and greedy.usage.prompt_tokens == len(tokenizer("Paris").input_ids)
    for ch in greedy.choices:  # rows of one batch: CPU BLAS may block row 0 apart from rows 1-2 (docs/serving.md)
        assert ch.logprobs.token_logprobs == pytest.approx(greedy.choices[0].logprobs.token_logprobs, abs=TOL)
    seeded = [
        [ch.text for ch in c.completions.create(model=NAME, prompt="Paris", max_tokens=8, n=3, seed=5).choices]
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1] and len(set(seeded[0])) == 3
    one = c.completions.create(model=NAME, prompt="Paris", max_tokens=8, seed=5)
    assert one.choices[0].text == seeded[0][0]
    prompts = ["Hello there", "Once upon a time"]
    both = c.completions.create(model=NAME, prompt=prompts, max_tokens=5, temperature=0, n=2)
    want = [tokenizer.decode(greedy_ids(engine, tokenizer(p).input_ids, 5), skip_special_tokens=True) for p in prompts]
    assert [(ch.index, ch.text) for ch in both.choices] == [(0, want[0]), (1, want[0]), (2, want[1]), (3, want[1])]
    assert both.usage.prompt_tokens == sum(len(tokenizer(p).input_ids) for p in prompts)
    assert both.usage.completion_tokens == 20
    chat = c.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, n=2
    )
    assert [ch.index for ch in chat.choices] == [0, 1] and chat.choices[0].message == chat.choices[1].message


def test_chat_logprobs_equal_a_plain_forward(server, engine):
    _, tokenizer = engine
    messages = [{"role": "user", "content": "Tell me a story"}]
    ids = tokenizer(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    ).input_ids
    new = greedy_ids(engine, ids, 6)
    ref = forward_logprobs(engine, ids + new)
    c = client(server)
    got = c.chat.completions.create(
        model=NAME, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = got.choices[0].logprobs.content
    assert got.choices[0].message.content == tokenizer.decode(new, skip_special_tokens=True)
    assert len(content) == len(new) == got.usage.completion_tokens
    for k, (entry, token) in enumerate(zip(content, new)):
        row = ref[len(ids) + k - 1]
        check_token(tokenizer, entry.token, token)
        assert abs(entry.logprob - row[token].item()) < TOL
        assert bytes(entry.bytes).decode(errors="replace") in (entry.token, "\ufffd") or entry.token.startswith(
            "bytes:"
        )
        values, best = row.topk(3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=TOL)
        for alt, t in zip(entry.top_logprobs, best.tolist()):
            check_token(tokenizer, alt.token, t)
    bare = c.chat.completions.create(model=NAME, messages=messages, max_tokens=3, temperature=0, logprobs=True)
    assert [e.top_logprobs for e in bare.choices[0].logprobs.content] == [[], [], []]
    assert c.chat.completions.create(model=NAME, messages=messages, max_tokens=3).choices[0].logprobs is None


def test_logprobs_are_the_models_before_the_requests_adjustments(server, engine):
    """A token forced by logit_bias +100 at temperature 0.7 is reported with the logprob the model gives it (about
    -6 on this model), not the ~0 the biased distribution gives it."""
    _, tokenizer = engine
    forced = tokenizer("Paris").input_ids[-1]
    ids = tokenizer("Hello there").input_ids
    got = client(server).completions.create(
        model=NAME, prompt="Hello there", max_tokens=4, temperature=0.7, seed=1, logprobs=1, logit_bias={forced: 100}
    )
    assert got.choices[0].text == tokenizer.decode([forced] * 4)
    check_completion_logprobs(engine, got.choices[0].logprobs, ids + [forced] * 4, len(ids), 1)
    assert max(got.choices[0].logprobs.token_logprobs) < -1


def sse_chunks(server, path, body):
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_streamed_logprobs_add_up_to_the_whole_answer(server):
    """Streamed with n=2, echo and logprobs: per choice, the chunks' texts and logprobs, joined, are the whole
    answer's; chat's streamed logprobs likewise; usage comes once, for every choice."""
    body = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 7, "temperature": 0, "n": 2, "logprobs": 2}
    body["echo"] = True
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    chunks = sse_chunks(server, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"] == whole["usage"] and chunks[-1]["choices"] == []
    for choice in whole["choices"]:
        mine = [ch["choices"][0] for ch in chunks[:-1] if ch["choices"][0]["index"] == choice["index"]]
        assert "".join(m["text"] for m in mine) == choice["text"]
        assert [m["finish_reason"] for m in mine][-1] == choice["finish_reason"] == "length"
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            joined = [x for m in mine if m["logprobs"] for x in m["logprobs"][key]]
            assert joined == choice["logprobs"][key], key
    messages = [{"role": "user", "content": "Hi"}]
    body = {"model": NAME, "messages": messages, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    whole = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    chunks = [ch["choices"][0] for ch in sse_chunks(server, "/v1/chat/completions", body)]
    assert chunks[0]["delta"]["role"] == "assistant"
    assert "".join(ch["delta"].get("content") or "" for ch in chunks) == whole["message"]["content"]
    assert [e for ch in chunks if ch["logprobs"] for e in ch["logprobs"]["content"]] == whole["logprobs"]["content"]
    echo = sse_chunks(server, "/v1/completions", {"model": NAME, "prompt": "Paris", "max_tokens": 0, "echo": True})
    assert [ch["choices"][0]["text"] for ch in echo] == ["Paris", ""]


def test_choices_batch_and_keep_their_logprobs(server, engine):
    """Each choice is its own sequence in the batch: n=4 decodes four rows together, and each row's logprobs still
    equal the plain forward's (batched logits differ from solo ones only in their last bits)."""
    _, tokenizer = engine
    before = httpx.get(f"{server.url}/metrics").text
    results = {}

    def ask(key, prompt):
        results[key] = client(server).completions.create(
            model=NAME, prompt=prompt, max_tokens=12, temperature=0, n=4, logprobs=3
        )

    threads = [threading.Thread(target=ask, args=(k, p)) for k, p in enumerate(["Paris", "1 2 3 4 5"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    after = httpx.get(f"{server.url}/metrics").text
    count, alone = "weightstream_decode_batch_size_count", ("weightstream_decode_batch_size_bucket", 'le="1.0"')
    batched = metric(after, count) - metric(before, count) - (metric(after, *alone) - metric(before, *alone))
    assert batched > 0
    for k, prompt in enumerate(["Paris", "1 2 3 4 5"]):
        ids = tokenizer(prompt).input_ids
        new = greedy_ids(engine, ids, 12)
        for choice in results[k].choices:
            assert choice.text == tokenizer.decode(new, skip_special_tokens=True)
            check_completion_logprobs(engine, choice.logprobs, ids + new, len(ids), 3)


def test_a_prompt_scored_in_chunks_equals_one_forward(engine):
    """The scheduler scores a long prompt a chunk of positions per forward (so it holds one chunk's logits at a
    time): chunks of 3 give the one forward's logprobs, and then the greedy tokens."""
    model, tokenizer = engine
    ids = tokenizer("Reading the gate projection first lets computation start sooner.").input_ids
    assert len(ids) > 7
    events = []
    sched = Scheduler(model, 4, 1 << 30, 1024, prompt_chunk=3)
    sched.start()
    try:
        params = SamplingParams(3, 0.0, logprobs=2, score_prompt=True)
        seq = Sequence(ids, params, tokenizer, frozenset(), events.append)
        sched.submit(seq)
        for _ in range(1200):  # a bounded wait: 2 minutes
            if seq.done:
                break
            time.sleep(0.1)
    finally:
        sched.stop()
    scored = next(e for e in events if isinstance(e, PromptScored)).logprobs
    assert isinstance(events[-1], Finished) and seq.generated == greedy_ids(engine, ids, 3)
    ref = forward_logprobs(engine, ids)
    assert scored[0].token == ids[0] and scored[0].logprob is None and scored[0].top is None
    for i in range(1, len(ids)):
        assert scored[i].token == ids[i] and abs(scored[i].logprob - ref[i - 1, ids[i]].item()) < TOL
        values, best = ref[i - 1].topk(2)
        assert [t for t, _ in scored[i].top] == best.tolist()
        assert [v for _, v in scored[i].top] == pytest.approx(values.tolist(), abs=TOL)
