"""`weightstream demo`: placeholder until its issue lands."""


def register(sub) -> None:
    p = sub.add_parser("demo", help="(not yet available)")
    p.set_defaults(func=lambda args: (print("weightstream demo is not available yet"), 2)[1])
