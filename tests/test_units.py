"""One size grammar for every option: binary GiB/MiB and bare G/M, decimal GB/MB, bytes; Nx only for caches."""

import pytest

from weightstream.cache.sizes import parse_cache_size
from weightstream.errors import WeightstreamError
from weightstream.sim.sizes import parse_sizes
from weightstream.units import format_bytes, page_ceil, page_floor, parse_size


@pytest.mark.parametrize(
    "text, value",
    [
        ("4GiB", 4 << 30),
        ("4G", 4 << 30),
        ("4Gi", 4 << 30),
        ("4 g", 4 << 30),
        ("512MiB", 512 << 20),
        ("512M", 512 << 20),
        ("1.5g", 3 << 29),
        ("64KiB", 64 << 10),
        ("1TiB", 1 << 40),
        ("4GB", 4 * 10**9),
        ("512MB", 512 * 10**6),
        ("1_073_741_824", 1 << 30),
        ("123", 123),
        ("123B", 123),
    ],
)
def test_the_grammar(text, value):
    assert parse_size(text) == value


def test_bench_and_prefetch_read_4g_alike():
    """They differed by 7% (1e9 against 2^30 per G) before there was one grammar."""
    assert parse_size("4G", "--memory-limit") == parse_size("4G", "--memory-budget") == 4 * 2**30


@pytest.mark.parametrize("bad", ["lots", "4 XB", "-1G", "1.2.3G", "x2", ""])
def test_bad_sizes_name_the_option(bad):
    with pytest.raises(WeightstreamError, match=f"--memory-limit {bad!r}: not a size; write bytes with a unit"):
        parse_size(bad, "--memory-limit")


def test_multiples_are_for_caches_only():
    with pytest.raises(WeightstreamError, match="not a size"):
        parse_size("1.5x")
    assert parse_cache_size("1.5x", 1000) == 1500 and parse_cache_size("2GiB", 1000) == 2 << 30
    with pytest.raises(WeightstreamError, match="needs a model or trace"):
        parse_cache_size("2x")
    assert parse_sizes("1x,4G,4GB", 10) == [10, 4 << 30, 4 * 10**9]


def test_format_and_pages():
    assert format_bytes(512) == "512 B" and format_bytes(1536) == "1.5 KiB" and format_bytes(13.8 * 2**30) == "13.8 GiB"
    assert format_bytes(3 * 2**40) == "3.0 TiB"
    assert page_floor(8191) == 4096 and page_ceil(4097) == 8192 and page_ceil(4096) == 4096
