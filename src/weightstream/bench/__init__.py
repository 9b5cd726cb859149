"""Measurement: runs in child processes, under memory cgroups, from a cold page cache, against device counters.

The only package that creates cgroups or drops the system's page cache. runner: `weightstream bench` (each
configuration in its own cgroup, tokens compared, cost model fitted); child: the child process that loads and
runs one configuration; cgroup: MemoryCgroup; coldstart: evicting a model's files and the system's page cache;
machine: machine facts and the block device's read counter; overlap: reader bandwidth and the overlap check;
calibrate and read_timing: `tune`'s short measurements of the engine and the reader; calibration_store: where
they are saved and reused, and bench's cost model read back.
"""
