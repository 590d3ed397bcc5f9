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
NATIVE_LIBRARIES = ("flashinfer", "b12x")


def env_flag(name: str, default: bool = False) -> bool:
    """Parse a boolean variable the way operators write them (``1``, ``true``, ``on``)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    return raw.strip().lower() not in _FALSE


@dataclasses.dataclass(frozen=True)
class Settings:
    """A snapshot of the configuration; see :data:`SETTINGS_DOC` for each field."""

    enabled: bool
    root: Path
    root_source: str
    target: str | None
    readonly: bool
    single_flight: bool = True
    lock_timeout: float = 300.0
    trust_shared: bool = False
    trust_group: int | None = None  # a gid whose members may write the root (CUTE_DISKCACHE_TRUST_GROUP)
    read_dirs: tuple[Path, ...] = ()  # read-only roots looked up after ``root`` (CUTE_DISKCACHE_READ_DIRS)
    hmac_key: bytes | None = dataclasses.field(default=None, repr=False)  # a secret: never in a repr or log
    remote: str | None = dataclasses.field(default=None, repr=False)  # a URL may carry a password
    remote_readonly: bool = False
    remote_timeout: float = 1.0
    remote_prefix: str = "cute-diskcache"
    remote_cooldown: float = 30.0
    native_sites: str = "cute-diskcache"  # who serves flashinfer >= 0.6.18's natively cached sites
    max_size: int = 5 * 10**9  # bytes; 0 = no cap
    remote_unsigned: bool = False  # accept remote entries without an HMAC signature (explicit opt-in)


#: name -> (environment variable, default, meaning). The README's table is made from this.
SETTINGS_DOC: dict[str, tuple[str, str, str]] = {
    "enabled": (ENABLE_ENV, "0", "1 turns the cache on at interpreter start (via the .pth hook) and in vLLM's plugin."),
    "root": (
        "CUTE_DISKCACHE_DIR",
        "see 'Where files go'",
        "Cache root. Else $FLASHINFER_WORKSPACE_DIR/cute_diskcache, else "
        "${FLASHINFER_WORKSPACE_BASE:-~}/.cache/flashinfer/cute_diskcache when flashinfer is "
        "installed, else the platformdirs user cache dir.",
    ),
    "target": (
        "CUTE_DISKCACHE_TARGET",
        "unset",
        "Name of a device profile (rtx-pro-6000, rtx-5090, ...) to compile for a card that is not present.",
    ),
    "host_cpu": (
        "CUTE_DISKCACHE_HOST_CPU",
        "portable",
        "Which CPU the host code of a new entry is written for: portable (x86-64-v2 on x86_64, armv8-a on aarch64: "
        "any serving host runs it), native (tuned for this CPU and recorded as such: only CPUs with every extension "
        "it has load it), or a baseline by name (x86-64-v2, x86-64-v3, x86-64-v4, armv8-a). Hits judge each entry "
        "by what it records, whatever this says.",
    ),
    "readonly": (
        "CUTE_DISKCACHE_READONLY",
        "0",
        "1 serves hits but never writes, locks or quarantines; misses compile in memory. A root we "
        "cannot write (read-only mount, no permission) is detected at the first miss and treated the same, with one warning.",
    ),
    "single_flight": (
        "CUTE_DISKCACHE_SINGLE_FLIGHT",
        "1",
        "When several processes miss the same kernel, one compiles and the others wait for its entry "
        "(flock under <root>/locks/). 0 lets every process compile.",
    ),
    "lock_timeout": (
        "CUTE_DISKCACHE_LOCK_TIMEOUT",
        "300",
        "Seconds a process waits for another one compiling the same kernel before it warns once and compiles it too. "
        "Every setting in seconds takes a finite number >= 0 (else its default, with one warning), at most 86400.",
    ),
    "trust_shared": (
        "CUTE_DISKCACHE_TRUST_SHARED",
        "0",
        "1 uses a root (or v1/, locks/) that another user owns or that group/others can write. Without it such a "
        "root is refused with one log line: nothing is read from it or written to it. A root owned by root that this "
        "uid cannot write (an image baked by docker build) needs no setting: it is served read-only.",
    ),
    "trust_group": (
        "CUTE_DISKCACHE_TRUST_GROUP",
        "unset",
        "A group (gid or name) whose members are trusted writers, narrower than TRUST_SHARED: a level that group may "
        "write, or that it owns, is used; one others may write, another group, or a POSIX ACL entry for anyone else, is "
        "still refused. For a Kubernetes fsGroup volume (group-owned, setgid, mode 2775): set it to the fsGroup. "
        "Directories we create get that group and mode 2775. Not a gid below 4294967295 nor a known name: no group, one warning.",
    ),
    "read_dirs": (
        "CUTE_DISKCACHE_READ_DIRS",
        "unset",
        "Colon-separated read-only cache roots looked up after CUTE_DISKCACHE_DIR, in order (as XDG_DATA_DIRS after "
        "XDG_DATA_HOME): an image-baked cache under a writable volume. A hit is loaded from the layer that has it; "
        "new entries go to CUTE_DISKCACHE_DIR; a layer is never written or quarantined. Absolute paths only (a relative "
        "one is ignored, with one warning); a missing one is said once. stats/list/verify see CUTE_DISKCACHE_DIR only.",
    ),
    "hmac_key": (
        "CUTE_DISKCACHE_HMAC_KEY",
        "unset",
        "Secret that signs every entry written (HMAC-SHA256 over the manifest, which holds every payload's "
        "sha256). When set, an unsigned or badly signed entry is a miss, never loaded, and stays where it is (it "
        "may be for hosts holding another key); this process's compile rewrites it signed.",
    ),
    "remote": (
        "CUTE_DISKCACHE_REMOTE",
        "unset",
        "A shared store behind the local cache (redis://host:6379/0, or an fsspec URL: s3://bucket/path, file:///mnt/x). "
        "A local miss fetches, verifies and stores the entry; a compile publishes it in the background. "
        "See 'Sharing a cache across a fleet'.",
    ),
    "remote_unsigned": (
        "CUTE_DISKCACHE_REMOTE_UNSIGNED",
        "0",
        "The remote tier is off unless CUTE_DISKCACHE_HMAC_KEY is set: whoever can write the remote store could "
        "otherwise ship native code to every node. 1 accepts unsigned remote entries anyway (one warning per process), "
        "for a store only trusted writers can reach.",
    ),
    "remote_readonly": (
        "CUTE_DISKCACHE_REMOTE_READONLY",
        "0",
        "1 fetches from the remote but never publishes to it (nodes that must not write the fleet's cache).",
    ),
    "remote_timeout": (
        "CUTE_DISKCACHE_REMOTE_TIMEOUT",
        "1",
        "Seconds one remote fetch may take, everything included; a publish (off the request path) gets 5 times that. "
        "Raise it for a distant object store.",
    ),
    "remote_prefix": (
        "CUTE_DISKCACHE_REMOTE_PREFIX",
        "cute-diskcache",
        "Prefix of every remote object name (<prefix>/v1/<namespace>/<digest>): fleets that must not share entries use different ones.",
    ),
    "remote_cooldown": (
        "CUTE_DISKCACHE_REMOTE_COOLDOWN",
        "30",
        "Seconds the remote is left alone after 3 failed calls in a row; then one call probes it.",
    ),
    "remote_lease": (
        "CUTE_DISKCACHE_REMOTE_LEASE",
        "1",
        "1: a node that misses locally and on the remote takes the kernel's lease there (Redis, S3) and the other nodes "
        "wait for its entry, so a fleet compiles each kernel once; 0: nodes that miss together each compile.",
    ),
    "max_size": (
        "CUTE_DISKCACHE_MAX_SIZE",
        "5G",
        "Size cap (500M, 5G, 2GiB; K/M/G/T decimal, Ki/Mi/Gi/Ti binary, as in ccache; 0 = no cap). Entries, the "
        "quarantine, staging, trash and statistics all count. Least-recently-used entries go first.",
    ),
    "target_force": (
        "CUTE_DISKCACHE_TARGET_FORCE",
        "0",
        "A target profile stands in for torch.cuda's device queries for the whole process, so it is refused (one "
        "warning; prewarm exits 2) when a CUDA device is visible. 1 applies it anyway.",
    ),
    "shared_objects": (
        "CUTE_DISKCACHE_SHARED_OBJECTS",
        "1",
        "1: a miss of a tvm-ffi kernel also links its object into a shared object (needs a C compiler, cc or $CC; "
        "20-80 ms), and a hit loads that (dlopen, ~0.5 ms) instead of the DSL's object loader (~4 ms). 0: the object "
        "alone, as before (entries with a shared object are still read).",
    ),
    "native_sites": (
        "CUTE_DISKCACHE_NATIVE_SITES",
        "cute-diskcache",
        "Who serves the static, micro and dynamic MoE kernels that flashinfer >= 0.6.18 caches itself. "
        "cute-diskcache: our cache, keyed without torch's build (flashinfer's own key has it, so a cache prewarmed "
        "with a CPU torch misses on the GPU box); flashinfer's cached_ops is then neither read nor written for them. "
        "flashinfer: flashinfer's own cache, as without cute-diskcache. A comma list of libraries whose own caches "
        "keep their kernels: flashinfer, b12x (b12x: the b12x package's compiles go to b12x's own disk cache, "
        "B12X_COMPILE_DISK_CACHE, and ours stays out of them; by default ours serves them and b12x's stands aside).",
    ),
    "on_miss": (
        "CUTE_DISKCACHE_ON_MISS",
        "compile",
        "What a kernel missing from the cache does in a serving process. compile: compile it (and store it), with one "
        "WARNING naming the site, the kernel and why it missed. warn: the same (vLLM's --jit-monitor-mode word). error: "
        "raise cute_diskcache.CacheMissError naming the kernel and why, compiling, locking and writing nothing (CI gates, "
        "canaries, a baked image that must be complete); the remote tier is not asked.",
    ),
    "log_level": (
        "CUTE_DISKCACHE_LOG_LEVEL",
        "info",
        "debug|info|warning|error|off. At info a serving process logs one line when the cache attaches (root, read-only "
        "or not, entries for this stack) and a summary at exit; every compile is a WARNING. Printed to stderr as "
        "'[cute-diskcache] LEVEL ...' unless the process configured a handler for the cute_diskcache logger or root "
        "(then through theirs). Unset, a level the application set on that logger is kept.",
    ),
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


DEFAULT_MAX_SIZE = "5G"
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
    return SETTINGS_DOC[field][0]


def flag(field: str) -> bool:
    """One boolean setting, read now, with the table's default.

    For code that needs a single switch on its own path (the loader at a hit, a target profile
    at start-up) without resolving the whole :class:`Settings` (which looks for flashinfer).
    """
    name, default, _meaning = SETTINGS_DOC[field]
    return env_flag(name, default=default == "1")


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
        lock_timeout=_float_env("CUTE_DISKCACHE_LOCK_TIMEOUT", 300.0),
        trust_shared=flag("trust_shared"),
        trust_group=trust_group(),
        read_dirs=read_dirs(root),
        hmac_key=_hmac_key(),
        remote=os.environ.get("CUTE_DISKCACHE_REMOTE", "").strip() or None,
        remote_readonly=flag("remote_readonly"),
        remote_timeout=_float_env("CUTE_DISKCACHE_REMOTE_TIMEOUT", 1.0) or 1.0,
        remote_prefix=os.environ.get("CUTE_DISKCACHE_REMOTE_PREFIX", "").strip().strip("/") or "cute-diskcache",
        remote_cooldown=_float_env("CUTE_DISKCACHE_REMOTE_COOLDOWN", 30.0),
        native_sites=_native_sites_env(),
        max_size=max_size(),
        remote_unsigned=flag("remote_unsigned"),
    )
