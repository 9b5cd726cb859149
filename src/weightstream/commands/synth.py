"""`weightstream synth`: placeholder until its issue lands."""


def register(sub) -> None:
    p = sub.add_parser("synth", help="(not yet available)")
    p.set_defaults(func=lambda args: (print("weightstream synth is not available yet"), 2)[1])
