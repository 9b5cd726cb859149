"""One module per `weightstream` subcommand: argument parsing and printing only; the work is in the packages.

Each defines `register(subparsers)`; cli.py lists them. progress: the shared progress bar on stderr. tune_steps and
tune_report: `tune`'s steps on one model and its answer (report, table, command, plot).
"""
