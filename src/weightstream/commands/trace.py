"""`weightstream trace`: placeholder until its issue lands."""


def register(sub) -> None:
    p = sub.add_parser("trace", help="(not yet available)")
    p.set_defaults(func=lambda args: (print("weightstream trace is not available yet"), 2)[1])
