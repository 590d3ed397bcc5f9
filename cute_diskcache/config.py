"""Every knob in one table: its environment variable, its default, and why it exists.

Settings are read from the environment each time :func:`load` is called, so a test or an
operator can change a variable and call ``install()`` again without restarting Python.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from pathlib import Path

#: The variable that turns the cache on for an unmodified serving engine.
ENABLE_ENV = "FLASHINFER_B12X_DISK_CACHE"

_FALSE = ("", "0", "false", "no", "off")
#: CUTE_DISKCACHE_NATIVE_SITES values; the first is the default (every library's sites ours).
NATIVE_SITES_CHOICES = ("cute-diskcache", "flashinfer")
#: Libraries CUTE_DISKCACHE_NATIVE_SITES may leave to their own caches (a comma list of them).
NATIVE_LIBRARIES = ("flashinfer", "b12x", "sglang", "vllm")


def env_flag(name: str, default: bool = False) -> bool:
    """Parse a boolean variable the way operators write them (``1``, ``true``, ``on``)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    return raw.strip().lower() not in _FALSE


@dataclasses.dataclass(frozen=True)
class Settings:
    """A snapshot of the configuration: each field is the setting of that name in :data:`SETTINGS`."""

    enabled: bool
    root: Path
    root_source: str
    target: str | None
    readonly: bool
    single_flight: bool
    lock_timeout: float
    trust_shared: bool
    trust_group: int | None  # a gid whose members may write the root
    read_dirs: tuple[Path, ...]  # read-only roots looked up after ``root``
    hmac_key: bytes | None = dataclasses.field(repr=False)  # a secret: never in a repr or log
    remote: str | None = dataclasses.field(repr=False)  # a URL may carry a password
    remote_readonly: bool
    remote_timeout: float
    remote_prefix: str
    remote_cooldown: float
    native_sites: str  # who serves flashinfer >= 0.6.18's natively cached sites
    max_size: int  # bytes; 0 = no cap
    remote_unsigned: bool  # accept remote entries without an HMAC signature (explicit opt-in)


#: name -> (environment variable, default as docs/settings.md writes it). This is where each
#: default lives; what a setting means is docs/settings.md's table alone (tests/test_docs.py holds
#: the two together: a row per setting, the same default).
SETTINGS: dict[str, tuple[str, str]] = {
    "enabled": (ENABLE_ENV, "0"),
    "root": ("CUTE_DISKCACHE_DIR", "see Where files go"),
    "target": ("CUTE_DISKCACHE_TARGET", "unset"),
    "host_cpu": ("CUTE_DISKCACHE_HOST_CPU", "portable"),
    "readonly": ("CUTE_DISKCACHE_READONLY", "0"),
    "single_flight": ("CUTE_DISKCACHE_SINGLE_FLIGHT", "1"),
    "lock_timeout": ("CUTE_DISKCACHE_LOCK_TIMEOUT", "300"),
    "trust_shared": ("CUTE_DISKCACHE_TRUST_SHARED", "0"),
    "trust_group": ("CUTE_DISKCACHE_TRUST_GROUP", "unset"),
    "read_dirs": ("CUTE_DISKCACHE_READ_DIRS", "unset"),
    "hmac_key": ("CUTE_DISKCACHE_HMAC_KEY", "unset"),
    "remote": ("CUTE_DISKCACHE_REMOTE", "unset"),
    "remote_unsigned": ("CUTE_DISKCACHE_REMOTE_UNSIGNED", "0"),
    "remote_readonly": ("CUTE_DISKCACHE_REMOTE_READONLY", "0"),
    "remote_timeout": ("CUTE_DISKCACHE_REMOTE_TIMEOUT", "1"),
    "remote_prefix": ("CUTE_DISKCACHE_REMOTE_PREFIX", "cute-diskcache"),
    "remote_cooldown": ("CUTE_DISKCACHE_REMOTE_COOLDOWN", "30"),
    "remote_lease": ("CUTE_DISKCACHE_REMOTE_LEASE", "1"),
    "max_size": ("CUTE_DISKCACHE_MAX_SIZE", "5G"),
    "target_force": ("CUTE_DISKCACHE_TARGET_FORCE", "0"),
    "shared_objects": ("CUTE_DISKCACHE_SHARED_OBJECTS", "1"),
    "native_sites": ("CUTE_DISKCACHE_NATIVE_SITES", "cute-diskcache"),
    "on_miss": ("CUTE_DISKCACHE_ON_MISS", "compile"),
    "log_level": ("CUTE_DISKCACHE_LOG_LEVEL", "info"),
}


#: The longest wait a setting may ask for: a day is longer than any compile or fetch, and a bound
#: that threading and time.sleep accept (1e300 overflows them; inf, 1e999 or nan would make a
#: bounded wait unbounded).
MAX_SECONDS = 86400.0
_warned: set[tuple[str, str]] = set()  # (variable, value) already warned about: one line per process


def warn_once(name: str, raw: str, message: str, *args: object) -> None:
    if (name, raw) in _warned:
        return
    _warned.add((name, raw))
    import logging

    logging.getLogger("cute_diskcache").warning(message, *args)


def _float_env(name: str, default: float) -> float:
    """A finite number of seconds from the environment, at most :data:`MAX_SECONDS`.

    Anything else (not a number, negative, inf, nan) keeps ``default``; more than the maximum is
    the maximum. Either way one warning per process and value, never an exception: a bad
    setting must not turn the cache off.
    """
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value < 0:
        warn_once(name, raw, "ignoring %s=%r (not a finite number of seconds >= 0); using %g", name, raw, default)
        return default
    if value > MAX_SECONDS:
        warn_once(name, raw, "%s=%r is more than %g s; using %g", name, raw, MAX_SECONDS, MAX_SECONDS)
        return MAX_SECONDS
    return value


def _hmac_key() -> bytes | None:
    """``CUTE_DISKCACHE_HMAC_KEY``'s bytes as the OS gave them (None: unset or empty).

    ``os.environ`` holds bytes that are not UTF-8 as surrogate escapes, which ``str.encode()``
    refuses (a UnicodeEncodeError that turned the cache off with no reason given);
    ``os.fsencode`` gives back exactly the bytes of the environment.
    """
    raw = os.environ.get("CUTE_DISKCACHE_HMAC_KEY", "")
    return os.fsencode(raw) or None


def _flashinfer_cache_dir() -> Path | None:
    """flashinfer's cache home (``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer``), or None.

    We compute it as ``flashinfer.jit.env`` documents instead of importing that module: the
    import pulls in all of flashinfer (and on some versions queries the GPU). We stop at the
    version-independent level on purpose: flashinfer's per-version leaf
    (``<version>/<archs>``) would orphan every entry on upgrade, and our namespaces already
    separate versions and arches.
    """
    import importlib.util

    if importlib.util.find_spec("flashinfer") is None:
        return None
    base = os.environ.get("FLASHINFER_WORKSPACE_BASE") or str(Path.home())
    return Path(base) / ".cache" / "flashinfer"


def _native_sites_env() -> str:
    """``CUTE_DISKCACHE_NATIVE_SITES``: ``cute-diskcache`` or a comma list of :data:`NATIVE_LIBRARIES`
    in that order (``flashinfer,b12x``); a value we do not know keeps the default, with a warning."""
    raw = (os.environ.get("CUTE_DISKCACHE_NATIVE_SITES") or "").strip().lower()
    if raw in NATIVE_SITES_CHOICES:
        return raw
    named = {part.strip() for part in raw.split(",")} - {""}
    if named and named <= set(NATIVE_LIBRARIES):
        return ",".join(lib for lib in NATIVE_LIBRARIES if lib in named)
    if raw:
        import logging

        logging.getLogger("cute_diskcache").warning(
            "ignoring CUTE_DISKCACHE_NATIVE_SITES=%r (expected %s, or a comma list of %s); using %s",
            raw, NATIVE_SITES_CHOICES[0], ", ".join(NATIVE_LIBRARIES), NATIVE_SITES_CHOICES[0])
    return NATIVE_SITES_CHOICES[0]


def left_to_library(library: str, native_sites: str | None = None) -> bool:
    """Whether ``CUTE_DISKCACHE_NATIVE_SITES`` (or ``native_sites``, a value :func:`load` gave) leaves
    ``library``'s natively cached sites to its own cache."""
    return library in (native_sites if native_sites is not None else _native_sites_env()).split(",")


DEFAULT_MAX_SIZE = SETTINGS["max_size"][1]
_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT][iI]?)?[bB]?\s*$")


def parse_size(text: str) -> int:
    """``"5G"`` -> 5e9 bytes. K/M/G/T are decimal, Ki/Mi/Gi/Ti binary, as in ccache; a trailing B is allowed."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 500M, 5G, 2GiB, 1048576)")
    number, unit = m.group(1), (m.group(2) or "").upper()
    value = float(number) * _UNITS[unit]
    if not math.isfinite(value):  # 400 digits are inf as a float: int() would raise OverflowError
        raise ValueError(f"not a size: {text!r} (too large)")
    return int(value)


def format_size(n: float) -> str:
    """Bytes as people read them, in the decimal units :func:`parse_size` takes."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def max_size() -> int:
    """``CUTE_DISKCACHE_MAX_SIZE`` in bytes (0: no cap); a value that is not a size keeps 5G, with a warning."""
    name = env_name("max_size")
    raw = os.environ.get(name, DEFAULT_MAX_SIZE)
    try:
        return parse_size(raw)
    except ValueError:
        warn_once(name, raw, "ignoring %s=%r (not a size); using %s", name, raw, DEFAULT_MAX_SIZE)
        return parse_size(DEFAULT_MAX_SIZE)


def env_name(field: str) -> str:
    """The environment variable of one setting (a KeyError for a setting the table lacks)."""
    return SETTINGS[field][0]


def flag(field: str) -> bool:
    """One boolean setting, read now, with the table's default.

    For code that needs a single switch on its own path (the loader at a hit, a target profile
    at start-up) without resolving the whole :class:`Settings` (which looks for flashinfer).
    """
    name, default = SETTINGS[field]
    return env_flag(name, default=default == "1")


def seconds(field: str) -> float:
    """One setting in seconds, read now (see :func:`_float_env`), with the table's default."""
    name, default = SETTINGS[field]
    return _float_env(name, float(default))


def text(field: str) -> str | None:
    """One string setting, read now; None when unset or blank."""
    return (os.environ.get(env_name(field)) or "").strip() or None


def _expanded(name: str) -> Path | None:
    """A directory variable with ``~`` expanded; None (next rule, one warning) when it cannot be.

    ``~someone`` for a user this host does not know makes ``expanduser`` raise RuntimeError,
    which must not turn the cache off from inside :func:`load`.
    """
    raw = os.environ.get(name)
    if not raw:
        return None
    try:
        return Path(raw).expanduser()
    except RuntimeError:
        warn_once(name, raw, "ignoring %s=%r (cannot expand ~: no such user or home directory)", name, raw)
        return None


def resolve_root() -> tuple[Path, str]:
    """Return the cache root and which rule chose it (shown by ``cute-diskcache stats``)."""
    explicit = _expanded("CUTE_DISKCACHE_DIR")
    if explicit is not None:
        return explicit, "CUTE_DISKCACHE_DIR"
    ws = _expanded("FLASHINFER_WORKSPACE_DIR")
    if ws is not None:
        return ws / "cute_diskcache", "FLASHINFER_WORKSPACE_DIR"
    try:
        fi_cache = _flashinfer_cache_dir()
    except RuntimeError:  # no home directory (an arbitrary uid without HOME nor a passwd entry)
        fi_cache = None
    if fi_cache is not None:
        return fi_cache / "cute_diskcache", "flashinfer cache dir"
    import platformdirs

    return Path(platformdirs.user_cache_dir("cute-diskcache", appauthor=False)), "user cache dir"


#: ``(gid_t)-1``: to ``chown`` "leave the group as it is", never a group; gids run below it.
_NO_GID = 2**32 - 1


def trust_group() -> int | None:
    """``CUTE_DISKCACHE_TRUST_GROUP`` as a gid: a number (ASCII digits, below 4294967295), or a
    group name this host knows; anything else trusts no group, with one warning (never a wider
    trust than asked for, never an exception: ``'²'`` passes ``str.isdigit`` and ``int`` raises on
    it; 20 digits overflowed ``chown`` inside a compile; 4294967295 made ``chown`` a no-op)."""
    raw = text("trust_group")
    if raw is None:
        return None
    name = env_name("trust_group")
    if raw.isascii() and raw.isdigit():
        if int(raw) < _NO_GID:
            return int(raw)
        warn_once(name, raw, "ignoring %s=%r (not a group id: gids run from 0 to %d); no group is trusted", name, raw, _NO_GID - 1)
        return None
    try:
        import grp

        return grp.getgrnam(raw).gr_gid
    except Exception:  # noqa: BLE001 - KeyError (no such group), a name the C library cannot take
        warn_once(name, raw, "ignoring %s=%r (no such group here; give the gid); no group is trusted", name, raw)
        return None


def read_dirs(root: Path) -> tuple[Path, ...]:
    """``CUTE_DISKCACHE_READ_DIRS``: the read-only layers, in order, without blanks, repeats or ``root`` itself.

    As XDG says of ``XDG_DATA_DIRS``, an entry that is not an absolute path is invalid and
    ignored (resolved against the working directory, one layer would be another directory in
    every process that started elsewhere), with one warning. One that does not exist (yet) is
    kept, with one warning: a volume may be mounted after start, and a typo must not go unsaid.
    """
    name = env_name("read_dirs")
    out: list[Path] = []
    for part in (os.environ.get(name) or "").split(os.pathsep):
        if part.strip():
            try:
                path = Path(part.strip()).expanduser()
            except RuntimeError:  # ~user this host does not know: that layer only, never load()
                warn_once(name, part, "ignoring %r in %s (cannot expand ~)", part, name)
                continue
            if not path.is_absolute():
                warn_once(name, part, "ignoring %r in %s (not an absolute path)", part, name)
                continue
            if path != root and path not in out:
                if not _is_dir(path):
                    warn_once(name, part, "%s lists %s, which is not a directory here: no hits from it until it is", name, path)
                out.append(path)
    return tuple(out)


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


def load() -> Settings:
    """Read the environment now."""
    root, source = resolve_root()
    return Settings(
        enabled=flag("enabled"),
        root=root,
        root_source=source,
        target=text("target"),
        readonly=flag("readonly"),
        single_flight=flag("single_flight"),
        lock_timeout=seconds("lock_timeout"),
        trust_shared=flag("trust_shared"),
        trust_group=trust_group(),
        read_dirs=read_dirs(root),
        hmac_key=_hmac_key(),
        remote=text("remote"),
        remote_readonly=flag("remote_readonly"),
        remote_timeout=seconds("remote_timeout") or float(SETTINGS["remote_timeout"][1]),  # 0 would time every fetch out
        remote_prefix=(text("remote_prefix") or "").strip("/") or SETTINGS["remote_prefix"][1],
        remote_cooldown=seconds("remote_cooldown"),
        native_sites=_native_sites_env(),
        max_size=max_size(),
        remote_unsigned=flag("remote_unsigned"),
    )
