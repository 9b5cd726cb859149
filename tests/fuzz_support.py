"""What the fuzz tests (tests/test_fuzz_*.py) share: hypothesis settings, mutations of valid inputs, and the checks
of the one property every target has: a clear error or a correct answer, never a traceback, a hang or a changed
input file.

Settings: each test runs its own small number of examples by default, derandomized (the same inputs every run, so
CI is reproducible and bounded: all the fuzz files take about 40 s on 2 cores) and without hypothesis's example
database (no failing example is replayed from an earlier run; `.hypothesis/` holds only hypothesis's own caches and
ignores itself in git). A longer run sets the environment variable WEIGHTSTREAM_FUZZ_EXAMPLES to the number of
examples each test tries, e.g.

    WEIGHTSTREAM_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest -q tests/test_fuzz_gguf.py \\
        --hypothesis-show-statistics

(`--hypothesis-show-statistics` prints how many inputs each test tried, how long they took, and the share of each
outcome a test counts with `outcome`: "refused", "imported", "HTTP 400", ...)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import struct

from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

EXAMPLES_VARIABLE = "WEIGHTSTREAM_FUZZ_EXAMPLES"
HANG_S = 30  # one input taking longer than this is a hang (the slowest target takes well under a second an input)


def examples(default: int) -> int:
    """`default`, or the number WEIGHTSTREAM_FUZZ_EXAMPLES asks for."""
    value = os.environ.get(EXAMPLES_VARIABLE, "").strip()
    if not value:
        return default
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{EXAMPLES_VARIABLE}={value!r}: give a whole number of examples, 1 or more")
    return int(value)


def fuzz(default: int):
    """The settings of one fuzz test: `default` examples (or WEIGHTSTREAM_FUZZ_EXAMPLES), derandomized, no deadline
    (a 2-core CI machine is slow at times; hangs are caught by `time_limit`), no example database."""
    return settings(
        max_examples=examples(default),
        derandomize=True,
        database=None,
        deadline=None,
        print_blob=False,
        phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),  # no explain: slow
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
            HealthCheck.function_scoped_fixture,
            HealthCheck.filter_too_much,
        ],
    )


def outcome(label: str) -> None:
    """Count an example's outcome ("refused", "imported", "HTTP 400"): `--hypothesis-show-statistics` lists the
    shares. Outside a fuzz test (the tests of the undamaged inputs) it does nothing."""
    if currently_in_test_context():
        event(label)


class Shown:
    """A fixture's value that a failing example names in a few words (hypothesis prints a test's arguments: the
    bytes of the files fuzzed are megabytes)."""

    def __init__(self, value, name: str):
        self.value, self.name = value, name

    def __getitem__(self, key):
        return self.value[key]

    def items(self):
        return self.value.items()

    def __repr__(self) -> str:
        return f"<{self.name}>"


class Hang(AssertionError):
    pass


@contextlib.contextmanager
def time_limit(what: str, seconds: float = HANG_S):
    """Fails with Hang when the block runs longer than `seconds` (SIGALRM: Python code is interrupted where it is)."""

    def expired(signum, frame):
        raise Hang(f"{what}: still running after {seconds} s (a hang)")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def digest(path) -> str:
    """sha256 of a file, or of every file under a directory (names and bytes): the input before and after."""
    h = hashlib.sha256()
    if os.path.isdir(path):
        for root, dirs, files in os.walk(path):
            dirs.sort()
            for name in sorted(files):
                full = os.path.join(root, name)
                h.update(os.path.relpath(full, path).encode() + b"\0")
                with open(full, "rb") as f:
                    h.update(f.read())
        return h.hexdigest()
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def assert_clear(message: str, *words: str) -> None:
    """A WeightstreamError's message: one line, naming each of `words` (the input, at least)."""
    assert message and "\n" not in message and "Traceback" not in message, message
    for word in words:
        assert word in message, (word, message)


# ------------------------------------------------------------------------------------------------------- mutations

# numbers that break counts, lengths, offsets and type ids: zero, one, off by one, sign bits, all ones, huge
INTERESTING = (0, 1, 2, 3, 7, 255, 256, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53, 2**63 - 1, 2**63)
INTERESTING += (2**64 - 1,)


def interesting_ints(bits: int = 64):
    """Integers for a field of `bits` bits: the interesting ones that fit, a value near one, or any."""
    top = 2**bits - 1
    fits = [v for v in INTERESTING if v <= top] + [top]
    return st.one_of(
        st.sampled_from(fits),
        st.builds(lambda v, d: max(0, min(top, v + d)), st.sampled_from(fits), st.integers(-2, 2)),
        st.integers(0, top),
    )


@st.composite
def mutated(draw, data: bytes, fields: tuple[tuple[int, int], ...] = (), hot: int | None = None) -> bytes:
    """`data` damaged by 1 to 4 edits: cut short, bytes flipped, a number field (`fields`: (offset, size 4 or 8),
    little-endian) given an interesting value, bytes inserted, deleted or duplicated. `hot`: most edits fall in the
    first `hot` bytes (a header), the rest anywhere."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        size = len(out)
        if size == 0:
            out += draw(st.binary(min_size=1, max_size=16))
            continue
        top = min(size, hot) if hot and draw(st.integers(0, 9)) else size
        pos = draw(st.integers(0, top - 1))
        op = draw(st.sampled_from(("cut", "flip", "byte", "number", "number", "insert", "delete", "repeat")))
        if op == "cut":
            del out[pos:]
        elif op == "flip":
            out[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "byte":
            out[pos] = draw(st.sampled_from((0x00, 0xFF, 0x7F, 0x80, 0x22, 0x5C, 0x30)))
        elif op == "number" and fields:
            at, width = draw(st.sampled_from(fields))
            value = draw(interesting_ints(8 * width))
            out[at : at + width] = struct.pack("<Q" if width == 8 else "<I", value)
            fields = ()  # offsets hold until the length changes; later edits go anywhere
        elif op == "number":
            width = draw(st.sampled_from((4, 8)))
            out[pos : pos + width] = struct.pack("<Q" if width == 8 else "<I", draw(interesting_ints(8 * width)))
        elif op == "insert":
            out[pos:pos] = draw(st.binary(min_size=1, max_size=64))
            fields = ()
        elif op == "delete":
            del out[pos : pos + draw(st.integers(1, 64))]
            fields = ()
        else:
            n = draw(st.integers(1, 64))
            out[pos:pos] = out[pos : pos + n]
            fields = ()
    return bytes(out)


def json_values(max_leaves: int = 8):
    """Any JSON value: scalars of every kind (huge and negative numbers, NaN and infinities as Python's json writes
    them, unicode text), lists and objects nested a few levels."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.sampled_from((0, -1, 1, 2**31, 2**63, -(2**63) - 1, 10**30)),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=20),
        st.sampled_from(("", "0", "1", "-1", "1e999", "nan", "\x00", "\ud7ff\uffff", "é", "[1, 2]")),
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
        max_leaves=max_leaves,
    )


HOSTILE_JSON = (
    b"[" * 100_000 + b"]" * 100_000,  # nested past the interpreter's recursion limit
    b'{"a": ' * 50_000 + b"1" + b"}" * 50_000,
    b"9" * 5000,  # an integer of more digits than Python converts
    b'{"experts": [' + b"9" * 5000 + b"]}",
    b'"\\ud800"',  # a lone surrogate: loads, then fails every encoder
    b'{"\\udfff": "\\ud800"}',
    b"NaN",
    b"[Infinity, -Infinity, NaN]",
    b"\xef\xbb\xbf{}",  # a byte-order mark
    b"\xff\xfe{\x00}\x00",  # UTF-16
    b"",
    b" \n",
    b"null",
    b"0",
    b'""',
    b"[]",
    b'{"a": 1, "a": 2}',
    b"{" + b'"k": [1, 2, 3], ' * 20_000 + b'"z": 0}',  # wide
)


class Text(bytes):
    """Bytes that a failing example shows by their start and length, not whole (some are 200 kB)."""

    def __repr__(self) -> str:
        return f"Text({bytes(self[:24])!r}... {len(self)} bytes)" if len(self) > 40 else f"Text({bytes(self)!r})"


def hostile_json():
    """JSON texts (bytes) every reader of JSON must survive: nesting past the recursion limit, 5000-digit integers,
    lone surrogates, NaN and Infinity, byte-order marks, UTF-16, nothing at all, duplicate keys, a wide object."""
    return st.sampled_from([Text(t) for t in HOSTILE_JSON])


def json_text(data, value, kind: str) -> bytes:
    """The bytes of a JSON file holding `value`; for `kind` "text" those bytes damaged (`mutated`), for "hostile" a
    text no JSON reader may crash on instead (`hostile_json`); `data`: the test's hypothesis data."""
    text = json.dumps(value).encode()
    if kind == "text":
        return bytes(data.draw(mutated(text), label="bytes"))
    if kind == "hostile":
        return bytes(data.draw(hostile_json(), label="json text"))
    return text
