"""Settings that are junk never make a bounded wait unbounded nor turn the cache off (issue 21, items 7, 9).

Synthetic entries, no compiles: what is checked is :func:`config.load` and the store's reading of
a signature, against what docs/settings.md (each setting's meaning; :data:`config.SETTINGS` holds
their variables and defaults) says of them.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path

import msgpack
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _helpers, whatever pytest's import mode

from _helpers import make_artifact, make_key  # noqa: E402

from cute_diskcache import config  # noqa: E402
from cute_diskcache.storage import entry  # noqa: E402
from cute_diskcache.storage.store import Store  # noqa: E402

SECONDS = {  # variable -> (Settings field, default)
    "CUTE_DISKCACHE_LOCK_TIMEOUT": ("lock_timeout", 300.0),
    "CUTE_DISKCACHE_REMOTE_TIMEOUT": ("remote_timeout", 1.0),
    "CUTE_DISKCACHE_REMOTE_COOLDOWN": ("remote_cooldown", 30.0),
}


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees its own first warning (config warns once per process and value)."""
    if hasattr(config, "_warned"):
        monkeypatch.setattr(config, "_warned", set())
    for name in SECONDS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("CUTE_DISKCACHE_HMAC_KEY", raising=False)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "cute_diskcache" and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("variable", sorted(SECONDS))
@pytest.mark.parametrize("raw", ["inf", "1e999", "-inf", "nan", "-1", "soon"])
def test_seconds_that_are_not_finite_keep_the_default(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, variable: str, raw: str
) -> None:
    """Measured on the old code: LOCK_TIMEOUT=1e999 and REMOTE_TIMEOUT=inf loaded as inf."""
    field, default = SECONDS[variable]
    monkeypatch.setenv(variable, raw)
    with caplog.at_level(logging.WARNING, logger="cute_diskcache"):
        values = [getattr(config.load(), field) for _ in range(3)]
    assert values == [default] * 3
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and variable in warnings[0], warnings


@pytest.mark.parametrize("variable", sorted(SECONDS))
def test_seconds_beyond_a_day_are_a_day(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, variable: str) -> None:
    """1e300 is finite, but threading's waits overflow on it (OverflowError); a day bounds every wait."""
    field, _default = SECONDS[variable]
    monkeypatch.setenv(variable, "1e300")
    with caplog.at_level(logging.WARNING, logger="cute_diskcache"):
        value = getattr(config.load(), field)
        config.load()
    assert math.isfinite(value) and value == 86400.0
    assert len(_warnings(caplog)) == 1


@pytest.mark.parametrize("variable", sorted(SECONDS))
def test_sane_seconds_pass_silently(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, variable: str) -> None:
    field, _default = SECONDS[variable]
    monkeypatch.setenv(variable, " 2.5 ")
    with caplog.at_level(logging.WARNING, logger="cute_diskcache"):
        assert getattr(config.load(), field) == 2.5
    assert _warnings(caplog) == []


def test_a_key_that_is_not_utf8_is_its_bytes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Measured on the old code: config.load raised UnicodeEncodeError, so the cache was off.

    os.environ holds the bytes the OS gave as surrogate escapes; the key is those bytes, and it
    signs and checks entries like any other.
    """
    secret = b"fleet \xff\xfe secret \x80"
    monkeypatch.setenv("CUTE_DISKCACHE_HMAC_KEY", os.fsdecode(secret))
    settings = config.load()
    assert settings.hmac_key == secret
    if hasattr(os, "environb"):
        assert settings.hmac_key == os.environb[b"CUTE_DISKCACHE_HMAC_KEY"]
    key, art = make_key("micro"), make_artifact()
    store = Store(tmp_path / "cache", hmac_key=settings.hmac_key)
    assert store.commit(key, art) is not None
    assert store.lookup_or_quarantine(key) is not None
    assert Store(tmp_path / "cache", hmac_key=b"fleet secret").lookup_or_quarantine(key) is None


def test_a_utf8_key_keeps_its_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys that loaded before load the same bytes now: entries signed before still verify."""
    monkeypatch.setenv("CUTE_DISKCACHE_HMAC_KEY", "clé-de-flotte")
    assert config.load().hmac_key == "clé-de-flotte".encode()
    monkeypatch.setenv("CUTE_DISKCACHE_HMAC_KEY", "")
    assert config.load().hmac_key is None


@pytest.mark.parametrize("how", ["another-key", "forged"])
def test_a_badly_signed_entry_is_a_miss_that_stays_as_documented(tmp_path: Path, how: str) -> None:
    """Issue 21, item 9: the settings table said a badly signed entry "is quarantined"; it is a
    miss and stays where it is (it may be for hosts holding another key). Text and code agree."""
    settings_md = (Path(__file__).resolve().parent.parent / "docs" / "settings.md").read_text()
    meaning = next(line for line in settings_md.splitlines() if line.startswith(f"| `{config.env_name('hmac_key')}` |"))
    assert "quarantine" not in meaning.lower(), meaning
    assert "badly signed" in meaning and "miss" in meaning and "stays" in meaning, meaning

    key, art = make_key("micro"), make_artifact()
    ours = b"our fleet"
    writer = Store(tmp_path / "cache", hmac_key=b"another fleet" if how == "another-key" else ours)
    assert writer.commit(key, art) is not None
    path = writer.entry_dir(key)
    if how == "forged":  # a signature that is not a signature of this manifest by anyone
        outer = msgpack.unpackb((path / entry.MANIFEST).read_bytes(), raw=False)
        outer["hmac"] = "0" * 64
        (path / entry.MANIFEST).write_bytes(msgpack.packb(outer, use_bin_type=True))
    before = {p.name: p.read_bytes() for p in path.iterdir()}

    store = Store(tmp_path / "cache", hmac_key=ours)
    assert store.lookup_or_quarantine(key) is None, "a badly signed entry is never loaded"
    assert store.rejected == 1
    assert not store.quarantine_dir.exists(), "nothing is quarantined"
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before, "the entry stays, byte for byte"


_JUNK = {
    "not-utf8": os.fsdecode(b"\xff\xfe\x80junk"),
    "inf": "inf",
    "1e999": "1e999",
    "400-digits": "9" * 400,
    "unknown-user-home": "~no-such-user-here/cache",
    "blank": "   ",
}


#: The settings of issue 21's review (a setting added later gets its own junk test with its reader).
_FIELDS_CHECKED = (
    "enabled", "root", "target", "readonly", "single_flight", "lock_timeout", "trust_shared", "hmac_key", "remote",
    "remote_unsigned", "remote_readonly", "remote_timeout", "remote_prefix", "remote_cooldown", "max_size",
    "target_force", "shared_objects", "native_sites",
)


@pytest.mark.parametrize("junk", sorted(_JUNK))
def test_load_never_raises_whatever_a_variable_holds(monkeypatch: pytest.MonkeyPatch, junk: str) -> None:
    """Every variable of the review's settings (and the root's fallback) set to junk at once: load answers.

    Measured on the old code: a non-UTF-8 key raised UnicodeEncodeError, 400 digits in
    CUTE_DISKCACHE_MAX_SIZE OverflowError, ``~no-such-user`` in CUTE_DISKCACHE_DIR RuntimeError.
    """
    for field in _FIELDS_CHECKED:
        monkeypatch.setenv(config.env_name(field), _JUNK[junk])
    monkeypatch.setenv("FLASHINFER_WORKSPACE_DIR", _JUNK[junk])
    settings = config.load()
    for field, _default in SECONDS.values():
        value = getattr(settings, field)
        assert math.isfinite(value) and 0 <= value <= 86400.0
    assert settings.max_size >= 0 and isinstance(settings.root, Path)
    assert not str(settings.root).startswith("~"), "an unexpandable home is not a directory named ~user"


def test_junk_size_keeps_the_default(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CUTE_DISKCACHE_MAX_SIZE", "9" * 400)
    with caplog.at_level(logging.WARNING, logger="cute_diskcache"):
        assert config.load().max_size == 5 * 10**9
        assert config.load().max_size == 5 * 10**9
    assert len(_warnings(caplog)) == 1


@pytest.mark.parametrize("raw", ["\u00b2", "\u0663", "-1", "99999999999999999999", "4294967295", "no-such-group-cdc", "0x7d0"])
def test_junk_trust_group_trusts_no_group_with_one_warning(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                                           tmp_path: Path, raw: str) -> None:
    """Issue 29, finding 9: a superscript two passes ``isdigit`` and ``int`` raised out of load()
    (a traceback in ``stats``, no attach); 20 digits raised OverflowError from chown out of a
    compile into flashinfer's call; 4294967295 is ``(gid_t)-1``, which chown reads as "no
    change", and the root was refused afterwards. Each is junk: no group, one warning, the cache works."""
    from cute_diskcache.core import export
    from cute_diskcache.core.cache import CompileCache

    monkeypatch.setenv("CUTE_DISKCACHE_TRUST_GROUP", raw)
    monkeypatch.setenv("CUTE_DISKCACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="cute_diskcache"):
        for _ in range(2):
            assert config.load().trust_group is None
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "CUTE_DISKCACHE_TRUST_GROUP" in warnings[0] and "no group is trusted" in warnings[0], warnings
    monkeypatch.setattr(export, "export", lambda kernel, digest, seconds, extra, device, **kw: make_artifact())
    cache = CompileCache(Store.for_settings(config.load()))
    assert cache.get_or_compile(make_key("micro"), lambda: "compiled")[0] == "compiled"
    assert cache.counters.writes == 1 and Store.for_settings(config.load()).lookup_or_quarantine(make_key("micro")) is not None


@pytest.mark.parametrize(("raw", "gid"), [("2000", 2000), (" 0 ", 0), ("4294967294", 4294967294), ("root", 0)])
def test_trust_group_takes_gids_and_names(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, raw: str, gid: int) -> None:
    monkeypatch.setenv("CUTE_DISKCACHE_TRUST_GROUP", raw)
    with caplog.at_level(logging.WARNING, logger="cute_diskcache"):
        assert config.load().trust_group == gid
    assert _warnings(caplog) == []
