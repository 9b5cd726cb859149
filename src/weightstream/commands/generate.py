"""`weightstream generate`: placeholder until its issue lands."""


def register(sub) -> None:
    p = sub.add_parser("generate", help="(not yet available)")
    p.set_defaults(func=lambda args: (print("weightstream generate is not available yet"), 2)[1])
