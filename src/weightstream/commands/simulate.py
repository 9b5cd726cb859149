"""`weightstream simulate`: placeholder until its issue lands."""


def register(sub) -> None:
    p = sub.add_parser("simulate", help="(not yet available)")
    p.set_defaults(func=lambda args: (print("weightstream simulate is not available yet"), 2)[1])
