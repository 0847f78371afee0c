"""docs/settings.md lists every setting: each key of settings.toml and each field of the settings
sections declared in ragcache/config.py appears there as `section.key`. No engine, no model."""

import re
import tomllib
from pathlib import Path

from ragcache.config import Settings

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "settings.md"
SETTINGS_TOML = REPO / "settings.toml"

# a key line of settings.toml, also one left commented out to show its default (`# cache_dir = ...`)
_KEY_LINE = re.compile(r"^#?\s*([a-z_][a-z0-9_]*)\s*=")
_SECTION_LINE = re.compile(r"^\[([a-z_]+)\]\s*$")


def _toml_keys() -> set[str]:
    """`section.key` for every key of settings.toml, commented-out defaults included."""
    keys, section = set(), None
    for line in SETTINGS_TOML.read_text(encoding="utf-8").splitlines():
        if m := _SECTION_LINE.match(line):
            section = m.group(1)
        elif section and (m := _KEY_LINE.match(line)):
            keys.add(f"{section}.{m.group(1)}")
    return keys


def _config_keys() -> set[str]:
    """`section.field` for every field of every settings section in ragcache/config.py."""
    return {f"{name}.{field}" for name, info in Settings.model_fields.items()
            for field in info.annotation.model_fields}


def _documented() -> set[str]:
    """The `section.key` names in the first column of docs/settings.md's tables."""
    return set(re.findall(r"^\| `([a-z_]+\.[a-z0-9_]+)` \|", DOC.read_text(encoding="utf-8"), re.M))


def test_toml_key_scan_matches_the_parsed_file():
    # the line scan must see what tomllib sees (plus the commented-out defaults), or the check below
    # could pass by reading too little
    parsed = tomllib.loads(SETTINGS_TOML.read_text(encoding="utf-8"))
    live = {f"{s}.{k}" for s, table in parsed.items() for k in table}
    assert live <= _toml_keys() and len(_toml_keys()) > 50


def test_settings_toml_declares_no_default_and_shows_config_s():
    """The defaults are declared once, in ragcache/config.py: settings.toml sets nothing, and each key
    it shows commented out carries config.py's default (the paths' defaults depend on the host and are
    shown as examples)."""
    text = SETTINGS_TOML.read_text(encoding="utf-8")
    assert not any(table for table in tomllib.loads(text).values()), "settings.toml sets a value"
    defaults = {name: info.annotation() for name, info in Settings.model_fields.items()}
    shown, section = 0, None
    for line in text.splitlines():
        if m := _SECTION_LINE.match(line):
            section = m.group(1)
        elif section and line.startswith("# ") and _KEY_LINE.match(line):
            key, value = next(iter(tomllib.loads(line[2:]).items()))
            default = getattr(defaults[section], key)
            if isinstance(default, Path):
                continue
            assert value == default or str(value) == str(default), f"{section}.{key}: shows {value!r}, default {default!r}"
            shown += 1
    assert shown > 50


def test_every_settings_toml_key_is_documented():
    missing = sorted(_toml_keys() - _documented())
    assert not missing, f"keys of settings.toml missing from docs/settings.md: {missing}"


def test_every_config_field_is_documented():
    missing = sorted(_config_keys() - _documented())
    assert not missing, f"fields of ragcache/config.py missing from docs/settings.md: {missing}"


def test_documented_keys_exist():
    # a key renamed or removed in the code must leave the reference too
    stale = sorted(_documented() - _config_keys())
    assert not stale, f"docs/settings.md lists settings that ragcache/config.py does not have: {stale}"
