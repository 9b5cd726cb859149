"""The served model: loading (in the background, so /health can say "loading"), the scheduler, and turning a
validated request into Sequences, one per choice (prompt tokens, max_tokens against the context and the KV
budget), and the Reply that gathers them."""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading
from dataclasses import dataclass, field, replace

import torch

from weightstream.engine.batching.batch import batchable
from weightstream.engine.batching.sampling import SamplingParams
from weightstream.engine.batching.scheduler import ExpertCacheFit, Refused, Scheduler
from weightstream.engine.batching.sequence import Sequence
from weightstream.engine.batching.steps import StepRecorder
from weightstream.engine.config import EngineConfig
from weightstream.engine.footprint import MEMORY_PREFILL_CHUNK
from weightstream.engine.kv_cache import quiet_cache_kwarg, stored_cache, takes_dynamic_cache
from weightstream.errors import WeightstreamError
from weightstream.serve.affinity import ExpertAffinity
from weightstream.serve.logprobs import ChatLogprobs, CompletionLogprobs, TokenText
from weightstream.serve.protocol import ApiError, ChatRequest, CompletionRequest, Reply, message_dicts
from weightstream.units import parse_size


@dataclass(slots=True, frozen=True)
class Prompt:
    """One prompt's token ids, and the string it was sent as (None: sent as token ids; echo decodes them)."""

    ids: list[int]
    text: str | None = None


def derived_seed(seed: int, choice: int) -> int:
    """The seed of a prompt's choice `choice` > 0 under a request's `seed`: distinct per choice, in 0 .. 2^63 - 1."""
    digest = hashlib.blake2b(f"{seed}/{choice}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


@dataclass(slots=True)
class ServeSettings:
    """What `weightstream serve` was asked to serve, and how."""

    model_dir: str
    engine: EngineConfig = field(default_factory=EngineConfig)  # or a dict of its fields
    model_name: str | None = None  # the name clients send as `model` (default: the directory's name)
    max_batch: int = 8
    max_queue: int = 128  # requests waiting for admission; more get 429
    batch_beyond_cache: bool = False  # batch past what the expert cache holds (scheduler.ExpertCacheFit)
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    kv_cache: str = "1GiB"
    api_key: str | None = None
    shutdown_grace_s: float = 10.0
    routing_trace: str | None = None  # replay this trace's routing (benchmarks; the text is then meaningless)
    step_log: str | None = None  # one JSON line per forward step
    # engine/shard_ray.py's ShardOptions: experts held by shard actors (--expert-shards); Ray must be running (serve's
    # command starts it in its main thread; a Ray Serve replica is in it)
    shards: object | None = None
    replay_by_prompt: bool = False  # routing_trace: a prompt replays the trace request it hashes to (replay.py)
    expert_affinity: bool = False  # record each prompt's prefill experts and the cache's for a router (affinity.py)
    prefill_chunk: int | None = None  # positions per prefill forward (None: one forward; --memory: 256)
    kv_budget_bytes: int = 0

    def __post_init__(self):
        if isinstance(self.engine, dict):
            self.engine = EngineConfig(**self.engine)
        if self.max_batch < 1:
            raise WeightstreamError(f"--max-batch {self.max_batch}: must be at least 1")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise WeightstreamError(f"--prefill-chunk {self.prefill_chunk}: must be at least 1 token")
        if self.engine.memory is not None:
            self.prefill_chunk = self.prefill_chunk or MEMORY_PREFILL_CHUNK
            if self.max_batch > self.prefill_chunk:  # a decode step is a forward of max_batch rows
                raise WeightstreamError(
                    f"--max-batch {self.max_batch} with --memory: a decode step of {self.max_batch} rows holds more "
                    f"than the {self.prefill_chunk}-token forward --memory measures (--prefill-chunk); give "
                    f"--max-batch {self.prefill_chunk} or less, or --prefill-chunk {self.max_batch} or more"
                )
        if self.max_queue < 1:
            raise WeightstreamError(f"--max-queue {self.max_queue}: must be at least 1 (every request waits briefly)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise WeightstreamError(f"--max-model-len {self.max_model_len}: must be at least 2 (a prompt and a token)")
        if self.shutdown_grace_s < 0:
            raise WeightstreamError(f"--shutdown-grace {self.shutdown_grace_s}: must be 0 or more seconds")
        self.kv_budget_bytes = parse_size(self.kv_cache, "--kv-cache")
        self.model_name = self.model_name or os.path.basename(os.path.normpath(self.model_dir))


# generation_config.json settings that `generate` applies even when greedy and serve does not: (field, neutral value)
_IGNORED_SETTINGS = (
    ("repetition_penalty", 1.0),
    ("no_repeat_ngram_size", 0),
    ("min_new_tokens", None),
    ("bad_words_ids", None),
    ("suppress_tokens", None),
    ("begin_suppress_tokens", None),
    ("sequence_bias", None),
)


def _warn_ignored_generation_settings(config) -> None:
    for name, neutral in _IGNORED_SETTINGS:
        value = getattr(config, name, neutral)
        if value not in (neutral, None):
            print(
                f"weightstream serve: note: generation_config.json sets {name}={value!r}; serve applies only the "
                "request's sampling fields, so its greedy output can differ from `generate`'s",
                file=sys.stderr,
            )


class ModelService:
    """Owns the model once loaded: `ready` after the warm-up step; `close()` stops the scheduler and I/O threads."""

    def __init__(self, settings: ServeSettings, observer=None, on_load_error=lambda: None):
        self.settings, self.observer, self.on_load_error = settings, observer, on_load_error
        self.on_ready = lambda: None
        self.model = self.tokenizer = self.scheduler = self.recorder = self.token_text = None
        self.affinity: ExpertAffinity | None = None
        self.replay = None  # the routing trace's replay, with settings.routing_trace
        self.ready, self.error, self.closed = False, None, False
        self.max_model_len = self.kv_bytes_per_token = 0
        self.eos_ids: frozenset[int] = frozenset()
        self._loader = threading.Thread(target=self._load_or_report, name="ws-load", daemon=True)
        self._shards = contextlib.ExitStack()  # the expert shards, with --expert-shards
        self.shard_plan: dict | None = None

    @property
    def model_name(self) -> str:
        return self.settings.model_name

    def start_loading(self) -> None:
        self._loader.start()

    def load(self) -> None:
        """Load tokenizer and model, measure KV bytes per position with one warm-up step, start the scheduler."""
        from weightstream.engine.loader import load_streaming_model, load_tokenizer

        s = self.settings
        self.tokenizer = load_tokenizer(s.model_dir, required=False)
        if self.tokenizer is None:
            raise WeightstreamError(f"{s.model_dir}: no usable tokenizer; serve needs the checkpoint's tokenizer files")
        self.token_text = TokenText(self.tokenizer)
        engine = s.engine
        if engine.memory is not None:  # --memory keeps room for the KV cache the batch may hold, and
            # measures with a prompt of one prefill chunk: no forward runs more positions (a longer prompt is chunked)
            engine = engine.replace(
                kv_cache_bytes=s.kv_budget_bytes, context=s.max_model_len, warmup_tokens=s.prefill_chunk
            )
        self.model = load_streaming_model(s.model_dir, engine)
        try:
            if s.shards is not None:
                from weightstream.engine.shard_ray import sharded

                self.shard_plan = self._shards.enter_context(sharded(self.model, s.model_dir, s.shards))
            self._configure()
        except BaseException:
            self._shards.close()
            self.model.weightstream.close()
            self.model = None
            raise
        self.ready = True
        self.on_ready()

    def _configure(self) -> None:
        s, model = self.settings, self.model
        limit = model.config.get_text_config().max_position_embeddings
        if s.max_model_len is not None and s.max_model_len > limit:
            raise WeightstreamError(f"--max-model-len {s.max_model_len}: this model's positions end at {limit}")
        self.max_model_len = s.max_model_len or limit
        if not takes_dynamic_cache(model):  # the scheduler holds, pads and measures each sequence's DynamicCache
            raise WeightstreamError(
                f"{model.config.model_type}: its transformers model keeps a cache of its own, not the DynamicCache "
                "serve holds each sequence's KV in; `weightstream generate` runs it"
            )
        self.kv_bytes_per_token = self._warm_up()
        if s.kv_budget_bytes < 2 * self.kv_bytes_per_token:
            raise WeightstreamError(
                f"--kv-cache {s.kv_cache}: holds fewer than 2 positions of this model's KV cache "
                f"({self.kv_bytes_per_token} bytes each); give at least {2 * self.kv_bytes_per_token} bytes"
            )
        if s.max_batch > 1 and not batchable(model.config):
            raise WeightstreamError(
                f"{model.config.model_type}: its KV cache layers are not ones serve can batch; use --max-batch 1"
            )
        _warn_ignored_generation_settings(model.generation_config)
        eos = model.generation_config.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.recorder = StepRecorder(model.weightstream, s.step_log)
        hooks, observer = [self.recorder], self.recorder
        if s.expert_affinity:
            self.affinity = observer = ExpertAffinity(model.weightstream, observer=self.recorder)
            hooks.append(self.affinity)
        model.weightstream.routing_observer = observer
        if s.routing_trace:
            hooks.insert(0, self._replay())
        self.scheduler = Scheduler(
            model,
            s.max_batch,
            s.kv_budget_bytes,
            self.kv_bytes_per_token,
            hooks,
            self.observer,
            self._expert_fit(),
            max_queue=s.max_queue,
            prefill_chunk=s.prefill_chunk,
        )
        self.scheduler.start()

    def _expert_fit(self) -> ExpertCacheFit | None:
        """The expert cache's bound on the batch (scheduler.py), unless every expert fits or it was turned off."""
        runtime = self.model.weightstream
        slots, experts = runtime.cache.n_slots, len(runtime.layout.experts)
        if self.settings.batch_beyond_cache or self.settings.max_batch == 1 or slots >= experts:
            return None
        per_row = runtime.layout.top_k * len(runtime.layout.num_experts)
        fit = ExpertCacheFit(slots, per_row, self.recorder.union_ratio)
        if not fit(2):
            print(
                f"weightstream serve: the expert cache holds {slots} experts and one sequence's step uses {per_row}, "
                f"so sequences are decoded one at a time (two would need {2 * per_row}); a larger --expert-cache "
                "lets them batch, --batch-beyond-cache batches anyway",
                file=sys.stderr,
            )
        return fit

    def _warm_up(self) -> int:
        """Run one position through the model (it proves the model runs); KV bytes that position took."""
        cache = stored_cache(self.model)
        token = self.tokenizer.bos_token_id or 0
        with torch.inference_mode(), quiet_cache_kwarg():
            self.model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)

    def _replay(self):
        from weightstream.engine.batching.replay import PromptRoutingReplay
        from weightstream.engine.routing import BatchRoutingReplay
        from weightstream.trace import load

        kind = PromptRoutingReplay if self.settings.replay_by_prompt else BatchRoutingReplay
        self.replay = kind(load(self.settings.routing_trace), self.model.weightstream.layout)
        self.model.weightstream.routing_override = self.replay
        return self.replay

    def _load_or_report(self) -> None:
        try:
            self.load()
        except BaseException as exc:  # the server must exit and say why; the CLI prints it as one line
            self.error = exc
            self.on_load_error()

    def close(self) -> None:
        """Fail what is in flight, stop the scheduler, then the expert cache's I/O threads. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self._loader.is_alive():
            self._loader.join()  # a load cannot be interrupted; what it built is closed below
        if self.scheduler is not None:
            self.scheduler.stop()
        if self.recorder is not None:
            self.recorder.close()
        self._shards.close()  # the shard actors
        if self.model is not None:
            self.model.weightstream.close()
        self.ready = False

    # --- requests ---

    def prompts(self, request: ChatRequest | CompletionRequest) -> list[Prompt]:
        """The request's prompts: chat messages through the checkpoint's chat template, or each completion prompt
        (a string, token ids, or a list of either), refused (400) when they and `n` make more sequences than the
        server queues."""
        if isinstance(request, ChatRequest):
            prompts = [Prompt(self._chat_ids(request))]
        else:
            given = request.prompt
            many = isinstance(given, list) and given and isinstance(given[0], (str, list))
            prompts = [self._prompt(item) for item in (given if many else [given])]
        choices, limit = len(prompts) * request.n, self.settings.max_queue
        if choices > limit:
            field = "n" if request.n > 1 else "prompt"
            raise ApiError(
                400,
                f"{field}: {len(prompts)} prompt(s) x n={request.n} make {choices} sequences, more than this server "
                f"queues (--max-queue {limit}); send fewer prompts or a smaller n per request",
                field,
            )
        return prompts

    def _prompt(self, given: str | list[int]) -> Prompt:
        if isinstance(given, str):
            return Prompt(self.tokenizer(given).input_ids, given)
        return Prompt(list(given))

    def _chat_ids(self, request: ChatRequest) -> list[int]:
        if not self.tokenizer.chat_template:
            raise ApiError(
                400,
                f"model {self.model_name!r} has no chat template (no chat_template in its tokenizer_config.json or "
                "chat_template.jinja), so messages cannot be rendered; use /v1/completions with a prompt, or add "
                "the model's chat template to the checkpoint",
                "messages",
                "chat_template_missing",
            )
        try:
            text = self.tokenizer.apply_chat_template(
                message_dicts(request), tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # the template's own checks (roles must alternate, ...) raise here
            raise ApiError(400, f"messages: the chat template refused them: {exc}", "messages") from None
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def sequences(self, request, prompts: list[Prompt], emitter) -> list[Sequence]:
        """The request's choices, prompt-major: `n` Sequences per prompt, choice i's events through `emitter(i)`.
        All are checked before any is made: a prompt or max_tokens that does not fit the context or the KV budget
        is a 400. With a seed, a prompt's first choice samples with it and choice j > 0 with a seed derived from
        it and j, so a prompt gets the same choices alone or in a list."""
        seqs = []
        for number, prompt in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt {number}"
            params = self._params(request, prompt.ids, where)
            for j in range(request.n):
                mine = params if j == 0 or params.seed is None else replace(params, seed=derived_seed(params.seed, j))
                index = number * request.n + j
                seqs.append(Sequence(prompt.ids, mine, self.tokenizer, self.eos_ids, emitter(index)))
        return seqs

    def reply(self, request, prompts: list[Prompt]) -> Reply:
        """The response builder for `request`'s choices."""
        chat = isinstance(request, ChatRequest)
        echo = getattr(request, "echo", False)
        texts = [(self.tokenizer.decode(p.ids) if p.text is None else p.text) if echo else "" for p in prompts]
        echoes = [text for text in texts for _ in range(request.n)]
        shape = None
        if request.top_logprobs_wanted() is not None:
            shape = (ChatLogprobs if chat else CompletionLogprobs)(self.token_text)
        return Reply(chat, self.model_name, echoes, sum(len(p.ids) for p in prompts), shape)

    def _params(self, request, ids: list[int], where: str) -> SamplingParams:
        """The sampling parameters for one prompt, or a 400 when it or max_tokens do not fit the context or the
        KV budget."""
        vocab = self.model.config.get_text_config().vocab_size
        if not ids:
            raise ApiError(400, f"{where}: it is empty (0 tokens); send at least one token", "prompt")
        if min(ids) < 0 or max(ids) >= vocab:
            raise ApiError(400, f"{where}: token ids must be in 0..{vocab - 1} for this model", "prompt")
        bias = request.bias_pairs()
        outside = [token for token, _ in bias if token >= vocab]
        if outside:
            raise ApiError(
                400,
                f"logit_bias: token id {outside[0]} is outside this model's vocabulary (0..{vocab - 1}); bias only "
                "ids its tokenizer produces",
                "logit_bias",
            )
        max_tokens = self._max_tokens(request, len(ids))
        try:
            self.scheduler.check_fits(len(ids) + max_tokens)
        except Refused as exc:
            raise ApiError(exc.status, str(exc), "max_tokens") from None
        top = request.top_logprobs_wanted()
        return SamplingParams(
            max_tokens,
            request.temperature,
            request.top_p,
            request.seed,
            request.stop_strings(),
            bias,
            request.presence_penalty,
            request.frequency_penalty,
            top,
            bool(getattr(request, "echo", False)) and top is not None,
        )

    def _max_tokens(self, request, n: int) -> int:
        room = self.max_model_len - n
        if request.max_tokens == 0 and "max_tokens" in request.model_fields_set:  # echo: the prompt scored alone
            if room < 0:
                raise ApiError(
                    400,
                    f"prompt: {n} tokens; this server's context is {self.max_model_len} tokens (--max-model-len); "
                    "shorten the prompt",
                    "prompt",
                    "context_length_exceeded",
                )
            return 0
        if room < 1:
            raise ApiError(
                400,
                f"prompt: {n} tokens; this server's context is {self.max_model_len} tokens (--max-model-len), "
                "which leaves no room for an answer; shorten the prompt",
                "prompt",
                "context_length_exceeded",
            )
        field = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) else "max_tokens"
        explicit = getattr(request, "max_completion_tokens", None) or (
            request.max_tokens if "max_tokens" in request.model_fields_set else None
        )
        if explicit is None:  # as much as the context and a lone request's KV budget allow, or the endpoint's default
            room_in_budget = self.settings.kv_budget_bytes // self.kv_bytes_per_token - n
            return max(1, min(room, room_in_budget, request.max_tokens or room))
        if explicit > room:
            raise ApiError(
                400,
                f"{field}: {explicit} new tokens after a {n}-token prompt exceed this server's context of "
                f"{self.max_model_len} tokens; ask for at most {room}",
                field,
                "context_length_exceeded",
            )
        return explicit

    def submit(self, seqs: list[Sequence], affinity_key: str | None = None) -> None:
        """Queue a request's sequences; `affinity_key` (from the Ray ingress) names their prefills' experts."""
        ids = [seq.id for seq in seqs]
        if self.affinity is not None and affinity_key:
            self.affinity.expect(ids, affinity_key)
        if self.settings.replay_by_prompt and self.replay is not None:
            for seq in seqs:
                self.replay.assign(seq.id, seq.prompt_ids)
        try:
            self.scheduler.submit(*seqs)
        except Refused as exc:
            self._forget(ids)
            headers = None if exc.retry_after_s is None else {"Retry-After": str(exc.retry_after_s)}
            raise ApiError(exc.status, str(exc), code=exc.code, headers=headers) from None

    def _forget(self, ids: list[int]) -> None:
        if self.affinity is not None:
            self.affinity.forget(ids)
        if self.settings.replay_by_prompt and self.replay is not None:
            for seq_id in ids:
                self.replay.forget(seq_id)
