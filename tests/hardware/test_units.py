"""The shared size and rate vocabulary."""

from __future__ import annotations

import pytest

from hybridmoe.backend.errors import UsageError
from hybridmoe.backend.units import GiB, MiB, UnitError, fmt_bytes, fmt_rate, parse_bytes, parse_rate


@pytest.mark.parametrize(
    "text, expected",
    [
        ("96GiB", 96 * GiB),
        ("96 GiB", 96 * GiB),
        ("1.5TB", 1_500_000_000_000),
        ("1.5 TiB", 1536 * GiB),
        ("97887MiB", 97_887 * MiB),
        ("97,887 MiB", 97_887 * MiB),
        ("768G", 768 * GiB),  # a bare letter counts like docker -m and free
        ("512k", 512 * 1024),
        ("4096", 4096),
        ("1_000 B", 1000),
        (".5 GiB", GiB // 2),
        ("  2 gib ", 2 * GiB),
        (123, 123),
        (1.5e9, 1_500_000_000),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "96 GiBs", "1,5TB", "-1GiB", "12 parsecs", "1229GB/s", True, None, -5])
def test_parse_bytes_refuses(text):
    with pytest.raises(UnitError) as caught:
        parse_bytes(text)
    # Both a user error the CLI prints and a ValueError for generic callers.
    assert isinstance(caught.value, UsageError) and isinstance(caught.value, ValueError)
    assert caught.value.hint


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1229GB/s", 1229e9),
        ("1.2 TB/s", 1.2e12),
        ("400GiB/s", 400 * GiB),
        ("900 GBps", 900e9),
        ("50 GB/sec", 50e9),
        ("1229GB", 1229e9),
        (1.2288e12, 1.2288e12),
    ],
)
def test_parse_rate(text, expected):
    assert parse_rate(text) == pytest.approx(expected)


def test_parse_rate_refuses():
    with pytest.raises(UnitError):
        parse_rate("fast/s")
    with pytest.raises(UnitError):
        parse_rate("-3GB/s")


def test_formatting():
    assert fmt_bytes(97_887 * MiB) == "95.6 GiB"
    assert fmt_bytes(143_771 * MiB) == "140.4 GiB"
    assert fmt_bytes(1536 * GiB) == "1,536.0 GiB"
    assert fmt_bytes(70_272) == "68.6 KiB"
    assert fmt_bytes(512) == "512 B"
    assert fmt_bytes(None) == "unknown"
    assert fmt_rate(1.2288e12) == "1,228.8 GB/s"
    assert fmt_rate(4.8e12) == "4,800.0 GB/s"
    assert fmt_rate(250e6) == "250.0 MB/s"
    assert fmt_rate(None) == "unknown"


def test_round_trip():
    for size in (97_887 * MiB, 768 * GiB, 1):
        assert parse_bytes(f"{size}B") == size
