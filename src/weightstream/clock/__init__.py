"""GPU clock floor during CPU-expert decode.

- activity: the engine's announcement client (stdlib only) and the daemon's listener;
- procscan: argv + CPU polling;
- uprobe: bpftrace on libllama.so;
- devfreq: GPUs with a devfreq node (Jetson), their min_freq raised;
- nvml: discrete NVIDIA GPUs, their clocks locked through NVML;
- backends: the choice between devfreq and nvml;
- state: the crash-repair record;
- daemon: the control loop;
- check: the read-only report;
- config: settings;
- fakes: a fake devfreq tree, a fake NVML and real child processes, for the tests and benchmarks/clockfloor.py.
"""
