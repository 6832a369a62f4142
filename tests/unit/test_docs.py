"""docs/profiles.md documents exactly the keys a profile has, with their defaults."""

import re
from pathlib import Path

from tiderl.profile import Profile, profile_to_dict

DOC = Path(__file__).resolve().parents[2] / "docs" / "profiles.md"


def flatten(values, prefix=""):
    for key, value in values.items():
        if isinstance(value, dict) and value:  # a section (an empty mapping is a value)
            yield from flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def documented_rows():
    rows = {}
    for line in DOC.read_text().splitlines():
        match = re.match(r"\| `([a-z0-9_.]+)` \| (`[^`]*`)? \|", line)
        if match:
            rows[match.group(1)] = match.group(2)
    return rows


def test_every_profile_key_is_documented_and_no_other():
    keys = dict(flatten(profile_to_dict(Profile())))
    rows = documented_rows()
    assert sorted(rows) == sorted(keys)


def test_documented_defaults_match_the_code():
    rows = documented_rows()
    for key, value in flatten(profile_to_dict(Profile())):
        shown = rows[key]
        if shown is None:
            continue
        text = shown.strip("`")
        if isinstance(value, bool):
            assert text == str(value).lower(), key
        elif isinstance(value, dict):
            assert text == "{}", key
        elif isinstance(value, list):
            assert text == "[" + ", ".join(map(str, value)) + "]", key
        elif isinstance(value, str):
            assert text in (value, f'"{value}"') or (value == "" and text == '""'), key
        else:
            assert float(text) == float(value), key
