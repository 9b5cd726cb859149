"""The expert cache: which experts stay (policies) and where their bytes go (slots).

- policy: the CachePolicy contract, LRU and `access_layer`, the one function that decides hits, misses and
  victims for both the runtime and the simulator's reference path;
- policies: SLRU, LFU, pinned, adaptive, byte budgets, and `make_policy`;
- sizes: cache sizes (bytes or multiples of the working set);
- slot_plan: where an expert's bytes are read to in its slot and where each parameter sits;
- inflight: read-aheads still landing;
- expert_cache: the ExpertSource contract and ExpertCache (policy + slots + reader).
"""
