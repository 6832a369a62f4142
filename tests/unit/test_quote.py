"""tiderl.core.quote: a value in an error shows as its start, an ellipsis and its length, in a
bounded number of characters."""

from tiderl.core.quote import LINE_LIMIT, QUOTE_LIMIT, cut, one_line, short

BIG = "x" * 10_000_000


def test_a_short_value_is_its_repr():
    assert short("ctb") == "'ctb'"
    assert short(0.5) == "0.5"
    assert short([1, 2]) == "[1, 2]"
    assert cut("nodes[0].port") == "nodes[0].port"
    assert short("y" * (QUOTE_LIMIT - 2)) == "'" + "y" * (QUOTE_LIMIT - 2) + "'"


def test_a_long_string_is_its_start_an_ellipsis_and_its_length_within_the_limit():
    suffix = "… (10,000,000 characters)"
    assert short(BIG) == "'" + "x" * (QUOTE_LIMIT - len(suffix) - 1) + suffix
    assert len(short(BIG)) == QUOTE_LIMIT
    assert short(b"\x00" * 1000, limit=30) == "b'\\x00\\x00\\x00\\… (1,000 bytes)"
    assert cut("abcdefghijklmnopqrstuvwxyz", limit=20) == "abc… (26 characters)"


def test_a_long_repr_is_cut_at_the_limit():
    numbers = list(range(10_000))
    assert short(numbers, limit=30) == f"[0, 1, 2,… ({len(repr(numbers)):,} characters)"


def test_one_line_joins_lines_and_bounds_the_whole():
    assert one_line("a\n  b\tc") == "a b c"
    line = one_line(f"key: got\n{BIG}")
    assert len(line) == LINE_LIMIT and line.startswith("key: got xxx")
    assert line.endswith("x… (10,000,009 characters)")
