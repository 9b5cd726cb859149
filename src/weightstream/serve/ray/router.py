"""The expert-affinity request router (Ray Serve's custom RequestRouter, Ray >= 2.46): a request goes to the replica
whose expert cache already holds the experts its prompt's prefill chose, while the load allows.

Per request, among the replicas whose ongoing requests are within `imbalance` of the least loaded one's:
1. experts: replicas report (record_routing_stats, serve/affinity.py) the experts each recent prompt's
   prefill chose, by affinity key, and the experts their caches hold now. For a prompt seen before, the replica that
   holds the most of its experts wins (ties: the less loaded).
2. prefix: the prompt was routed before but no report names it yet (reports come every
   request_routing_stats_period_s): the replica it went to.
3. least_loaded: a new prompt, or none holds any of its experts; `imbalanced` when the preferred replica is busier
   than the least loaded by more than `imbalance`: the least loaded takes it.
The preferred replica comes first, the others after it (a full replica passes the request on). Every decision is
counted in Ray's metrics export: weightstream_router_decisions_total{reason, replica}.
"""

from __future__ import annotations

import logging
import random
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
from ray.util.metrics import Counter

REASONS = ("experts", "prefix", "least_loaded", "imbalanced")
logger = logging.getLogger("ray.serve")


def decide(key, stats: dict, loads: dict, imbalance: int, routed: dict, rng: random.Random) -> tuple[object, str]:
    """(replica id, reason) for a request of affinity `key` (None: no prompt to key on). `stats`: replica id -> its
    routing stats; `loads`: replica id -> ongoing requests; `routed`: key -> replica id it last went to."""
    least = min(loads.values())
    balanced = [r for r in loads if loads[r] <= least + imbalance]
    preferred, reason = _by_experts(key, stats, loads), "experts"
    if preferred is None and routed.get(key) in loads:
        preferred, reason = routed[key], "prefix"
    if preferred in balanced:
        return preferred, reason
    calmest = [r for r in balanced if loads[r] == least]
    return rng.choice(sorted(calmest, key=str)), "least_loaded" if preferred is None else "imbalanced"


def _by_experts(key, stats: dict, loads: dict):
    """The replica holding the most of the experts `key`'s prefills chose (as any replica reported them); None when
    no report names the key or no replica holds any of them."""
    if key is None:
        return None
    wanted = 0
    for report in stats.values():
        wanted |= int(report.get("prefills", {}).get(key, "0"), 16)
    if not wanted:
        return None
    held = {r: (int(stats.get(r, {}).get("resident", "0"), 16) & wanted).bit_count() for r in loads}
    best = max(held.values())
    if best == 0:
        return None
    return min((r for r in held if held[r] == best), key=lambda r: (loads[r], str(r)))


class ExpertAffinityRouter(RequestRouter):
    """Ray Serve's hooks around `decide`; request_router_kwargs: imbalance (default 2), remembered (keys, 4096)."""

    def initialize_state(self, imbalance: int = 2, remembered: int = 4096, seed: int | None = None):
        self.imbalance, self.remembered, self.rng = imbalance, remembered, random.Random(seed)
        self.routed: OrderedDict[str, object] = OrderedDict()
        self.decisions = Counter(
            "weightstream_router_decisions",
            description="Requests the expert-affinity router sent, by reason (experts, prefix, least_loaded, "
            "imbalanced) and replica",
            tag_keys=("reason", "replica", "deployment", "application"),
        )

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # every replica is a candidate every time
        if not candidate_replicas:
            return []
        loads = await self._loads(candidate_replicas)
        key = _affinity_key(pending_request)
        stats = {r.replica_id: r.routing_stats or {} for r in candidate_replicas}
        chosen, reason = decide(key, stats, loads, self.imbalance, self.routed, self.rng)
        self._record(key, chosen, reason)
        first = [r for r in candidate_replicas if r.replica_id == chosen]
        rest = [r for r in candidate_replicas if r.replica_id != chosen]
        return [first, rest] if rest else [first]

    async def _loads(self, replicas: list[RunningReplica]) -> dict:
        """Ongoing requests per replica: the router's cache of them, else asked (no answer: counted as full)."""
        loads, unknown = {}, []
        for r in replicas:
            known = self._replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            (unknown.append(r) if known is None else loads.__setitem__(r.replica_id, known))
        for r, queued in await self._probe_queue_lens(unknown, 0):
            loads[r.replica_id] = r.max_ongoing_requests if queued is None else queued
        return loads

    def _record(self, key, chosen, reason: str) -> None:
        if key is not None:
            self.routed[key] = chosen
            self.routed.move_to_end(key)
            while len(self.routed) > self.remembered:
                self.routed.popitem(last=False)
        tags = {
            "reason": reason,
            "replica": chosen.unique_id,
            "deployment": self._deployment_id.name,
            "application": self._deployment_id.app_name,
        }
        self.decisions.inc(tags=tags)
        logger.debug("weightstream router: key %s -> %s (%s)", key, chosen.unique_id, reason)


def _affinity_key(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None:
        return None
    return next((a.affinity_key for a in pending_request.args if hasattr(a, "affinity_key")), None)
