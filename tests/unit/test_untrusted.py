"""elastrun.untrusted: bounded JSON decoding and terminal-safe text."""

from __future__ import annotations

import pytest

from elastrun.untrusted import UntrustedData, depth, loads, printable


def test_deep_nesting_is_refused_without_recursion() -> None:
    with pytest.raises(UntrustedData, match="nested more than 32"):
        loads(b"[" * 100000, max_bytes=1 << 20)
    with pytest.raises(UntrustedData, match="nested"):
        loads('{"a":' * 40 + "1" + "}" * 40, max_bytes=1 << 20)


def test_brackets_inside_strings_do_not_count() -> None:
    text = '{"stack": "' + "[" * 1000 + '\\"{{"}'
    assert depth(text.encode()) == 1
    assert loads(text, max_bytes=1 << 20)["stack"].startswith("[[[")


def test_size_and_syntax_are_checked() -> None:
    with pytest.raises(UntrustedData, match="is 11 bytes"):
        loads(b'"xxxxxxxxx"', max_bytes=10, what="a note")
    with pytest.raises(UntrustedData, match="not valid JSON"):
        loads(b"{nope", max_bytes=100)
    assert loads(b'{"a": [1, {"b": 2}]}', max_bytes=100) == {"a": [1, {"b": 2}]}


def test_printable_escapes_terminal_controls() -> None:
    hostile = "\x1b]0;owned\x07\x1b[2J\x1b[31mALERT\r\u202egnp.exe"
    shown = printable(hostile)
    assert "\x1b" not in shown and "\x07" not in shown and "\r" not in shown
    assert "\u202e" not in shown
    assert shown.startswith("\\x1b]0;owned\\x07")
    assert "\\u202e" in shown
    assert printable("a\nb\tc") == "a\\x0ab\\x09c"
    assert printable("a\nb\tc", lines=True) == "a\nb\tc"
    assert printable("x" * 10, limit=4) == "xxxx..."
    assert printable("héllo wörld") == "héllo wörld"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"a": [1, {"b": [2]}], "c": {}}', 4),  # no escapes: the fast path
        ('{"a": "[{", "b": [[]]}', 3),  # brackets in a string, no escapes
        ('{"a": "\\"[", "b": [{}]}', 3),  # an escaped quote before a bracket in a string
        ("[" * 70 + "]" * 70, 70),  # deeper than the passes tried: counted one by one
        ("]][[[", 1),  # unbalanced: the deepest running count
        ('"unterminated [[', 2),  # no string ends: the brackets count
        ("[}{]", 1),  # kinds mixed: counted alike
    ],
)
def test_depth_counts_brackets_outside_strings(text: str, expected: int) -> None:
    assert depth(text.encode()) == expected


def test_depth_is_linear_for_hostile_nesting() -> None:
    """A million brackets, balanced or not, are counted (no quadratic passes)."""
    assert depth(b"[" * 500_000 + b"]" * 500_000) == 500_000
    assert depth(b"[" * 1_000_000) == 1_000_000


@pytest.mark.timeout(60)  # the quadratic scan took ~700 s here; the linear one milliseconds
def test_depth_is_linear_for_a_text_of_escaped_quotes() -> None:
    """An unterminated string of 200,000 escaped quotes: each quote was a new
    start of the string pattern, each scanning to the end."""
    assert depth(b'"' + b'\\"' * 200_000) == 0
    assert depth(b'["' + b'\\"' * 200_000 + b"[[") == 3  # after no string's end: brackets count
