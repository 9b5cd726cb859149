"""`weightstream clockfloor`: placeholder until its issue lands."""


def register(sub) -> None:
    p = sub.add_parser("clockfloor", help="(not yet available)")
    p.set_defaults(func=lambda args: (print("weightstream clockfloor is not available yet"), 2)[1])
