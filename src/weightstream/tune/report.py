"""`weightstream tune`'s answer as data: the search over policies and sizes, the recommendation with the
`weightstream generate` command that runs it, the page cache against the expert cache, llama.cpp's lines, and the
`--miss-copy` configurations apart; everything `--json` prints (commands/tune_report.py prints it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from weightstream.sim.advice import llamacpp_advice, recommend, verdict
from weightstream.sim.cost_model import CostModel
from weightstream.sim.miss_copy import MissCopy
from weightstream.sim.replay import pinned_set
from weightstream.sim.tune import MISS_COPY_UPGRADES, Config, Search
from weightstream.units import GIB, MIB

if TYPE_CHECKING:
    from weightstream.sim.overlap_model import CostParams


@dataclass(frozen=True, slots=True)
class Cost:
    """What prices tune's configurations: the overlap model's fitted params (None where no calibration is at hand
    and bench's line prices alone), bench's linear cost model (None: the overlap model prices), and what was used
    (for the report)."""

    params: CostParams | None
    linear: CostModel | None
    info: dict


EXAMPLE_PROMPT = "Hello"


def generate_command(
    model_dir: str,
    rec: Config,
    io_threads: int,
    max_new_tokens: int,
    pinned: str | None,
    memory: str | None = None,
    largest_cache: int | None = None,
    kv_dtype: str = "auto",
):
    """argv of the `weightstream generate` run that uses the recommended configuration. Where that is an expert
    cache as large as the budget allows (`largest_cache`, the largest size priced) and not a pinned set, the command
    gives `--memory` (tune's own SIZE, `memory`): the engine then measures its footprint and takes the largest
    cache that fits (docs/memory.md), at least the one priced here; otherwise it names the cache size. A `--miss-copy`
    configuration (`extra["miss_copy"]`) gets `--miss-copy --upgrade-after` its setting."""
    argv = ["weightstream", "generate", model_dir]
    if rec.path == "page-cache":
        argv += ["--expert-source", "page-cache"]
    else:
        sized = memory is not None and rec.cache_bytes == largest_cache and not pinned
        argv += ["--memory", memory] if sized else ["--expert-cache", str(rec.cache_bytes)]
        argv += ["--policy", rec.policy, "--io-threads", str(io_threads)]
        if pinned:
            argv += ["--pinned-experts", pinned]
        if rec.extra.get("miss_copy"):
            argv += ["--miss-copy", "--upgrade-after", str(rec.extra["upgrade_after"])]
    if kv_dtype != "auto":
        argv += ["--kv-dtype", kv_dtype]
    return argv + ["--max-new-tokens", str(max_new_tokens), "--prompt", EXAMPLE_PROMPT]


def build_report(
    session,
    trace,
    routing: dict,
    cost: Cost,
    policies: list[str],
    max_new_tokens: int,
    gpu_memory_bytes: int | None,
) -> dict:
    """Search, recommend and advise; everything `--json` prints. `gpu_memory_bytes` as `tune --gpu-memory` gave it
    (parsed and checked with the other arguments, `commands.tune._check_args`)."""
    search = Search(trace, session.facts, cost.params, cost.linear)
    facts = session.facts
    miss_copy = None
    if facts.small_read_bytes:  # the checkpoint has small copies: price --miss-copy too, from the same replays
        miss_copy = MissCopy(facts.small_read_bytes / facts.read_bytes, MISS_COPY_UPGRADES)
    configs = search.run(session.budget.expert_bytes, policies, miss_copy=miss_copy)
    rec, reason = recommend(configs)
    pinned = None
    if rec.policy == "pinned":
        pinned = session.write_pinned(pinned_set(search.w, rec.slots, search.options), rec.slots)
    who_wins = verdict(configs)
    page = next(c for c in configs if c.path == "page-cache")
    largest = max((c.cache_bytes for c in configs if c.path != "page-cache"), default=None)
    memory = f"{session.budget.memory_bytes // MIB}MiB"
    command = generate_command(
        session.model_dir, rec, session.io_threads, max_new_tokens, pinned, memory, largest, session.kv_dtype
    )
    if miss_copy is not None:
        small = _miss_copy_answer(session, search, rec, max_new_tokens, memory, largest)
    else:
        small = _miss_copy_hint(session, search, configs, rec)
    return {
        "model": session.model_dir,
        "budget": session.budget.to_dict(),
        "routing": routing,
        "calibration": cost.info,
        "cost_model": "linear (bench)" if cost.linear is not None else "overlap",
        "configs": [c.to_dict() for c in configs],
        "recommendation": {**rec.to_dict(), "reason": reason, "command": command, "pinned_experts_file": pinned},
        "page_cache_vs_expert_cache": {
            "winner": who_wins.winner,
            "ratio": who_wins.ratio,
            "expert_cache_loses_up_to_bytes": who_wins.loses_up_to_bytes,
            "line": who_wins.line,
        },
        "llama_cpp": llamacpp_advice(session.facts, session.budget, page, gpu_memory_bytes, who_wins),
        # --miss-copy, kept apart from the exact configurations above: never the recommendation, tokens not exact
        "miss_copy": small,
    }


MISS_COPY_LABEL = "NOT exact: tokens differ from the model's"


def _miss_copy_answer(session, search: Search, exact: Config, max_new_tokens: int, memory: str, largest) -> dict:
    """--miss-copy priced at every policy, size and upgrade setting (`search.miss_copy_configs`) and its own
    recommendation, labelled as not exact, with the command; compared with the exact recommendation `exact`."""
    configs = search.miss_copy_configs
    rec, reason = recommend(configs)
    pinned = None
    if rec.policy == "pinned":
        pinned = session.write_pinned(pinned_set(search.w, rec.slots, search.options), rec.slots)
    command = generate_command(
        session.model_dir, rec, session.io_threads, max_new_tokens, pinned, memory, largest, session.kv_dtype
    )
    tok_s, exact_tok_s = rec.predicted_decode_tokens_per_s, exact.predicted_decode_tokens_per_s
    quant = session.quant
    return {
        "available": True,
        "exact": False,
        "label": MISS_COPY_LABEL,
        "small_copy_bits": quant.miss_copy.bits if quant is not None and quant.miss_copy else None,
        "small_copy_ratio": configs[0].extra["small_copy_ratio"] if configs else None,
        "upgrade_after": [c for c in dict.fromkeys(c.extra["upgrade_after"] for c in configs)],
        "configs": [c.to_dict() for c in configs],
        "recommendation": {
            **rec.to_dict(),
            "reason": reason,
            "command": command,
            "pinned_experts_file": pinned,
            "vs_exact_recommendation_tokens_per_s": tok_s / exact_tok_s if tok_s and exact_tok_s else None,
            "vs_exact_recommendation_mib_read_per_token": rec.mib_read_per_token / exact.mib_read_per_token
            if exact.mib_read_per_token
            else None,
        },
    }


def _miss_copy_hint(session, search: Search, configs: list[Config], exact: Config) -> dict | None:
    """Where a Q4_K checkpoint has no small copies: what `quantize --miss-bits 2` would save, simulated at the exact
    recommendation's policy and size (or the fastest expert cache's, where the page cache is recommended) with the
    copies' bytes estimated from the blob table (Q2_K, Q4_0 where a weight's inputs are not whole blocks of 256)."""
    quant = session.quant
    if quant is None or quant.scheme != "q4_k" or quant.miss_copy is not None:
        return None
    ratio = estimated_small_ratio(quant)
    at = exact if exact.path == "expert-cache" else _fastest_expert_cache(configs)
    if ratio is None or at is None:
        return None
    upgrade, never = search.miss_copy(at.policy, at.cache_bytes, MissCopy(ratio, (1, None)))
    line = (
        f"small copies (`weightstream quantize SRC --bits 4 --miss-bits 2 --out DIR`, SRC the original checkpoint, "
        f"then `--miss-copy`) would make a miss read about {ratio:.2f}x the bytes: at {at.policy} "
        f"{at.cache_bytes / GIB:.2f} GiB a token would read {never.mib_read_per_token:.1f} MiB with --upgrade-after "
        f"never, {upgrade.mib_read_per_token:.1f} with the default upgrade after 1, against "
        f"{at.mib_read_per_token:.1f} exact (simulated; {MISS_COPY_LABEL})"
    )
    return {
        "available": False,
        "exact": False,
        "estimated_small_copy_ratio": ratio,
        "policy": at.policy,
        "cache_bytes": at.cache_bytes,
        "mib_read_per_token": {
            "exact": at.mib_read_per_token,
            "1": upgrade.mib_read_per_token,
            "never": never.mib_read_per_token,
        },
        "line": line,
    }


def _fastest_expert_cache(configs: list[Config]) -> Config | None:
    pool = [c for c in configs if c.path == "expert-cache" and not c.bound]
    return max(pool, key=lambda c: (c.predicted_decode_tokens_per_s or 0, -c.mib_read_per_token), default=None)


def estimated_small_ratio(quant) -> float | None:
    """A Q2_K small copy's bytes over its blob's, from the blob table as `quantize --miss-bits 2` would write it
    (`store.quantize.miss_copy_format`: Q2_K, Q4_0 for a weight whose inputs are not whole super-blocks of 256)."""
    from weightstream.native import BLOCK_TYPES, row_bytes

    small = 0
    for t in quant.tensors:
        if t.dtype not in BLOCK_TYPES:  # biases: kept as they are
            small += t.nbytes
            continue
        n, k = t.shape
        small += n * row_bytes("Q2_K" if k % BLOCK_TYPES["Q2_K"].elements == 0 else "Q4_0", k)
    return small / quant.blob_bytes if quant.blob_bytes else None
