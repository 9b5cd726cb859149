"""GPU clock floor during CPU-expert decode.

activity: the engine's announcement client (stdlib only) and the daemon's listener; procscan: argv + CPU
polling; uprobe: bpftrace on libllama.so; devfreq / nvml: the two clock backends, chosen in backends;
state: the crash-repair record; daemon: the control loop; check: the read-only report; config: settings.
"""
