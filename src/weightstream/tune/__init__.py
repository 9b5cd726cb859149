"""`weightstream tune` on one model, above the engine, the simulator and measurement it joins (commands/tune.py
parses and commands/tune_report.py prints):

- session: budget, routing (a trace or recorded), calibration (this machine measured, saved beside the model), the
  engine loaded only when routing or the machine must be measured;
- report: the answer as data: the search over policies and sizes (sim/tune.py), the recommendation with the
  `weightstream generate` command that runs it, page cache against expert cache and llama.cpp's lines
  (sim/advice.py), `--miss-copy` apart; everything `--json` prints.
"""
