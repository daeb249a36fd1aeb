"""The size syntax of pycomm's benchmarks (pycomm.tools.benchmark.parse_size / human_size)."""
import pytest

from pycomm.tools.benchmark import human_size, parse_size


@pytest.mark.parametrize("text,n", [("4096", 4096), ("64K", 65536), ("64KiB", 65536), ("16M", 16 << 20),
                                    ("16mb", 16 << 20), ("1G", 1 << 30), ("1.5K", 1536), (" 8 ", 8)])
def test_parse_size(text, n):
    assert parse_size(text) == n


def test_parse_size_names_bad_input():
    with pytest.raises(ValueError, match=r"not a size: '12Q'"):
        parse_size("12Q")


@pytest.mark.parametrize("n,text", [(64 << 20, "64 MiB"), (4096, "4 KiB"), (1 << 30, "1 GiB"), (1000, "1000 B"),
                                    (1536, "1536 B")])
def test_human_size(n, text):
    assert human_size(n) == text
