"""The expert-affinity router's decision (router.decide) on replicas' reports as replicas send them, and the
affinity key the ingress computes (serve/affinity.py): deterministic, no cluster."""

import random

import pytest

from weightstream.serve.affinity import PREFIX_CHARS, affinity_key

pytest.importorskip("ray", reason="Ray Serve is not installed (pip install 'weightstream[ray]')")

from weightstream.serve.ray.router import decide  # noqa: E402


def report(resident: set[int], prefills: dict[str, set[int]] | None = None) -> dict:
    """A replica's routing stats as ExpertAffinity.report() writes them: bitmaps as hex."""
    bits = lambda experts: format(sum(1 << e for e in experts), "x")  # noqa: E731
    return {"experts": 64, "resident": bits(resident), "prefills": {k: bits(v) for k, v in (prefills or {}).items()}}


def test_the_replica_holding_most_of_the_prompts_experts_wins():
    stats = {"a": report({0, 1, 2, 3}, {"k": {0, 1, 2, 3, 4, 5}}), "b": report({4, 5, 6})}
    assert decide("k", stats, {"a": 1, "b": 0}, 2, {}, random.Random(0)) == ("a", "experts")
    stats["b"] = report({1, 2, 3, 4, 5})  # b now holds more of them (the report said where the prompt ran, not why)
    assert decide("k", stats, {"a": 0, "b": 0}, 2, {}, random.Random(0)) == ("b", "experts")


def test_ties_go_to_the_less_loaded_and_a_busy_replica_yields():
    stats = {"a": report({0, 1}, {"k": {0, 1}}), "b": report({0, 1})}
    assert decide("k", stats, {"a": 2, "b": 1}, 2, {}, random.Random(0)) == ("b", "experts")
    stats["b"] = report(set())
    assert decide("k", stats, {"a": 3, "b": 0}, 2, {}, random.Random(0)) == ("b", "imbalanced")
    assert decide("k", stats, {"a": 2, "b": 0}, 2, {}, random.Random(0)) == ("a", "experts")  # within the bound


def test_before_any_report_a_prompt_follows_its_last_replica_and_a_new_one_the_least_loaded():
    stats = {"a": report(set()), "b": report(set())}
    assert decide("k", stats, {"a": 1, "b": 0}, 2, {"k": "a"}, random.Random(0)) == ("a", "prefix")
    assert decide("k", stats, {"a": 1, "b": 0}, 2, {}, random.Random(0)) == ("b", "least_loaded")
    assert decide(None, stats, {"a": 0, "b": 2}, 2, {"k": "b"}, random.Random(0)) == ("a", "least_loaded")
    gone = {"b": report(set())}  # the replica it last went to has died: not a candidate any more
    assert decide("k", gone, {"b": 0}, 2, {"k": "a"}, random.Random(0)) == ("b", "least_loaded")
    idle = {decide("new", stats, {"a": 0, "b": 0}, 2, {}, random.Random(seed))[0] for seed in range(20)}
    assert idle == {"a", "b"}  # equally idle replicas share new prompts


def test_no_replica_holding_any_of_the_experts_falls_back_to_routing_by_prefix_then_load():
    stats = {"a": report({9}, {"k": {0, 1}}), "b": report({8})}
    assert decide("k", stats, {"a": 0, "b": 0}, 2, {"k": "b"}, random.Random(0)) == ("b", "prefix")


def test_the_affinity_key_is_the_prompts_beginning():
    same = affinity_key({"model": "m", "prompt": "x" * PREFIX_CHARS + " and then one thing"})
    assert same == affinity_key({"model": "m", "prompt": "x" * PREFIX_CHARS + " and then another", "n": 2})
    assert affinity_key(b'{"prompt": "Hello"}') != affinity_key(b'{"prompt": "Hullo"}')
    chat = {"messages": [{"role": "user", "content": "Hello"}]}
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]}
    assert affinity_key(chat) == affinity_key(parts) != affinity_key({"prompt": "Hello"})
    assert affinity_key({"prompt": ["Hello", "Bye"]}) == affinity_key({"prompt": "Hello"})
    assert affinity_key({"prompt": [1, 2, 3]}) != affinity_key({"prompt": [1, 2, 4]})
    assert affinity_key(b"not json") is None and affinity_key({"model": "m"}) is None
