"""Verification of a persistent tier: read every stored entry in full, report it, and have the
damaged ones removed (``TieredStore.verify``, ``ragcache cache verify``).

Owns: :func:`verify_tier` and the shape of its report. The store decides what removing a damaged
entry means (delete it, count it): it passes that in as ``discard``. Imports only the entry, format,
tier and guard modules; must not import vLLM, the store, nor anything above kvstore.
"""

from __future__ import annotations

from typing import Any, Callable, Literal

from ragcache.kvstore.entry import CorruptEntryError, ForeignEntryError, KVMeta, TierError
from ragcache.kvstore.guard import TierDown, TierGuard
from ragcache.kvstore.tier import Tier

Outcome = Literal["ok", "foreign", "gone", "error", "down"]


Mismatch = Callable[[KVMeta], "str | None"]


def verify_tier(
    tier: Tier, guard: TierGuard, mismatch: Mismatch | None, discard: Callable[[str, CorruptEntryError], None]
) -> dict[str, Any]:
    """Check every entry of ``tier`` (header, size and every checksum).

    Args:
        tier: a persistent tier.
        guard: its availability state; a tier that is down (or goes down meanwhile) is reported
            with ``up`` False and not checked further.
        mismatch: why an entry is not the store's (another model, layout or stored form: ``foreign``),
            None when it is (``TieredStore.mismatch``); None = every intact entry is ``ok``.
        discard: called with the key and error of each damaged entry; expected to delete it.

    Returns:
        ``{"checked", "ok", "foreign", "corrupt", "removed": [keys], "damage": {key: what}, "up"}``:
        ``ok`` counts intact entries of the store, ``foreign`` intact entries of another model,
        layout, stored form or format, ``corrupt`` the damaged ones (their keys in ``removed``, what
        was wrong with each in ``damage``: "checksum mismatch in v.3", "non-finite values in
        v_scale.0"...). Entries that vanished meanwhile or could not be read (logged) are not counted.
    """
    rep: dict[str, Any] = {"checked": 0, "ok": 0, "foreign": 0, "corrupt": 0, "removed": [], "damage": {},
                           "up": True}
    try:
        keys = list(guard.call(tier.keys)) if guard.available() else None
    except (TierDown, TierError, OSError):
        keys = None
    if keys is None:
        rep["up"] = False
        return rep
    for key in keys:
        outcome = _verify_one(tier, guard, mismatch, key, discard)
        if outcome == "down":
            rep["up"] = False
            break
        if isinstance(outcome, CorruptEntryError):
            rep["removed"].append(key)
            rep["damage"][key] = outcome.reason
            outcome = "corrupt"
        if outcome in ("ok", "foreign", "corrupt"):
            rep["checked"] += 1
            rep[outcome] += 1
    return rep


def _verify_one(
    tier: Tier, guard: TierGuard, mismatch: Mismatch | None, key: str,
    discard: Callable[[str, CorruptEntryError], None]
) -> Outcome | CorruptEntryError:
    """Check one stored entry; a damaged one is handed to ``discard`` and its error returned."""
    try:
        reader = guard.call(tier.open, key)
        if reader is None:
            return "gone"  # deleted meanwhile
        try:
            reader.read_all()
        finally:
            reader.close()
    except TierDown:
        return "down"
    except ForeignEntryError:
        return "foreign"
    except CorruptEntryError as exc:
        discard(key, exc)
        return exc
    except (TierError, OSError) as exc:
        guard.warn("verify", f"{tier.name} tier: cannot check {key!r} ({exc})")
        return "error"
    if mismatch is not None and mismatch(reader.meta) is not None:
        return "foreign"
    return "ok"
