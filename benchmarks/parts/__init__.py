"""The benchmarks' subcommands, one module each (`main(argv, prog)`), run by name by the entry points in
`benchmarks/` (`llamacpp.py speed`, `kernel_bench.py layer`, ...). What they share is in `common/`."""
