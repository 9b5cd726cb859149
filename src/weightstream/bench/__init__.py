"""Measurement: runs in child processes, under memory cgroups, from a cold page cache, against device counters.

The only package that creates cgroups or drops the system's page cache.
- runner: `weightstream bench` (each configuration in its own cgroup, tokens compared, cost model fitted);
- child: the child process that loads and runs one configuration;
- cgroup: MemoryCgroup, a child memory cgroup with a hard limit and no swap;
- coldstart: evicting a model's files and the system's page cache;
- reclaim: the kernel's proactive reclaim (DAMON) paused while something measures the page cache;
- machine: machine facts and the block device's read counter;
- overlap: reader bandwidth and the overlap check;
- calibrate: `tune`'s short measurements of the engine on this machine;
- read_timing: `tune`'s measurement of the reader landing a layer's misses;
- calibration_store: where calibrations are saved and reused, and bench's cost model read back.
"""
