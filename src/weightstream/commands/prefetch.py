"""`weightstream prefetch`: placeholder until its issue lands."""


def register(sub) -> None:
    p = sub.add_parser("prefetch", help="(not yet available)")
    p.set_defaults(func=lambda args: (print("weightstream prefetch is not available yet"), 2)[1])
