"""Load templates (`weightstream prefetch`): learn the order a loader reads weight files, replay it ahead next time.

Event sources, what the kernel says the loader missed or touched:
- tracefs: a private tracefs instance (root);
- rawtrace: its binary ring-buffer pages;
- events: event records and the text parser;
- residency: mincore sampling without root;
- procs: the wrapped command and the weight files it has open or mapped.
Templates:
- merge: misses into ordered ranges;
- template: the per-worker ranges and file identities;
- spec: deployment specs and their key;
- store: templates on disk.
Replay:
- plan: chunks per worker;
- cursor: where a loader is in its template;
- pages: per-page flags;
- prefetcher: interruptible prefetch within a budget, burn-after-reading;
- fetch: readahead and reclaim of one range;
- numa: page placement near an accelerator;
- memory: headroom of the system and the cgroup.
Orchestration:
- record: `prefetch record`'s work;
- run: `prefetch run`'s work;
- settings: options and counters;
- report: what a run did.
"""
