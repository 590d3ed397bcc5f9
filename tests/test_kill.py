"""Writers SIGKILLed at random points: no partial entry is ever served, and the next run recovers.

A kill during a compile costs seconds to stage, so most of the kills here land where a crash
could actually corrupt something: in the commit. A small driver process rewrites one key
over and over with synthetic artifacts (random bytes from a seed, no DSL needed) through
``Store.commit``; the test SIGKILLs it after a random delay, many times, while a reader
thread looks the key up throughout. Every entry a reader ever gets must be byte-for-byte one
the driver (or the test) committed in full, regenerated from the seed in its manifest; no
reader may ever see a damaged entry; after each kill a commit succeeds and is served.

One more test kills a real engine start in the middle of its compile (while it holds the
key's single-flight lock) and checks that the next start compiles once and commits what the one
after would hit: judged in-process under the cold start's key (``_next_start``), as a fresh
start's lookup judges it; that a start hits what verifies under that key is proven in fresh
processes by test_corruption's next-start cases and test_roundtrip.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

sys.path.insert(0, str(Path(__file__).resolve().parent))  # conftest, whatever pytest's import mode

from _next_start import assert_next_start_would_hit  # noqa: E402
from conftest import PROBE_TIMEOUT_S, TARGET, child_env, split_stderr  # noqa: E402

from cute_diskcache.storage import entry, locking  # noqa: E402
from cute_diskcache.keys.key import CacheKey  # noqa: E402
from cute_diskcache.storage.store import Store  # noqa: E402

if TYPE_CHECKING:
    from conftest import Warm

KILLS = 30
MAX_DELAY_S = 0.4

#: Shared by the driver (a fresh process) and the test: the key and the artifact of commit ``tag``.
#: Kept free of torch so the driver starts in a fraction of a second.
COMMON = textwrap.dedent(
    '''
    import random
    from cute_diskcache.storage import entry
    from cute_diskcache.keys.key import CacheKey, Environment

    def the_key():
        env = Environment(kind="flashinfer-moe", package="flashinfer-python==0.6.15.post1", sources="5" * 64,
                          arch="sm_120a", dsl=(("nvidia-cutlass-dsl", "4.8.1"),), codegen_env=(), machine="x86_64")
        return CacheKey(env, "flashinfer.moe_dispatch.micro", ("micro", 128, 1, 2048, 768, 8), "--opt-level 2")

    def artifact(tag):
        rng = random.Random(tag)
        return entry.Artifact(
            object_bytes=rng.randbytes(rng.randrange(4096, 65536)),
            symbol="cdc_kill",
            tvm_ffi=True,
            cubins=[rng.randbytes(rng.randrange(1024, 16384)) for _ in range(rng.randrange(0, 3))],
            mlir_text="module { // " + rng.randbytes(512).hex() + " }",
            compile_seconds=1.0,
            export_seconds=0.01,
            extra={"tag": tag},
        )
    '''
)

DRIVER = COMMON + textwrap.dedent(
    '''
    import sys
    from pathlib import Path
    from cute_diskcache.storage.store import Store

    root, seed = Path(sys.argv[1]), sys.argv[2]
    store, key = Store(root), the_key()
    print("ready", flush=True)
    i = 0
    while True:
        tag = f"{seed}/{i}"
        assert store.commit(key, artifact(tag)) is not None, "a commit on a healthy disk must succeed"
        print(tag, flush=True)  # printed only once the commit returned
        i += 1
    '''
)

_common: dict[str, Any] = {}
exec(compile(COMMON, "<test_kill.COMMON>", "exec"), _common)


def the_key() -> CacheKey:
    key: CacheKey = _common["the_key"]()
    return key


def artifact(tag: str) -> entry.Artifact:
    art: entry.Artifact = _common["artifact"](tag)
    return art


def _served(found: tuple[dict[str, Any], bytes] | None) -> str | None:
    """The tag of what a lookup served, after checking it is exactly that commit's artifact."""
    if found is None:
        return None
    manifest, obj = found
    tag = manifest["extra"]["tag"]
    expected = artifact(tag)
    assert obj == expected.object_bytes, f"served object is not commit {tag}'s"
    sizes = sorted(p["size"] for p in manifest["payloads"]["cubin"])
    assert sizes == sorted(len(c) for c in expected.cubins), f"served cubins are not commit {tag}'s"
    return str(tag)


class Reader(threading.Thread):
    """Looks the key up in a loop, read-only (so it never moves anything), recording what it was served."""

    def __init__(self, root: Path) -> None:
        super().__init__(daemon=True)
        self.store = Store(root, readonly=True)
        self.key = the_key()
        self.stop = threading.Event()
        self.served: set[str | None] = set()
        self.lookups = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.served.add(_served(self.store.lookup_or_quarantine(self.key)))
                self.lookups += 1
        except BaseException as exc:  # reported by the test thread
            self.error = exc


def _temp_files(root: Path) -> list[Path]:
    return sorted(root.rglob(".tmp.*"))


def test_commits_killed_at_random_points(tmp_path: Path) -> None:
    root = tmp_path / "root"
    key = the_key()
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    rng = random.Random(int(os.environ.get("CDC_KILL_SEED", "4")))
    reader = Reader(root)
    reader.start()
    committed: set[str] = set()  # every tag whose commit returned (driver's or ours)
    interrupted: set[str] = set()  # the commit each kill cut short (it may have landed)
    last_recovery: str | None = None
    mid_commit = 0
    t_start = time.monotonic()
    try:
        for n in range(KILLS):
            proc = subprocess.Popen([sys.executable, str(driver), str(root), f"run{n}"], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            # Some kills right at the first commit, the rest anywhere in a stream of commits.
            time.sleep(rng.uniform(0, 0.01) if n % 4 == 0 else rng.uniform(0, MAX_DELAY_S))
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            # Through the reader that read "ready": it may have read the first tags with it (a slow
            # parent, a fast child). communicate() would read the pipe beneath it and lose them, and
            # under load did (kill 15 counted 25 commits for 26, and its landed 26th looked foreign).
            out = proc.stdout.read()
            proc.stdout.close()
            assert proc.returncode == -signal.SIGKILL
            done = [ln for ln in out.splitlines() if ln]
            committed.update(done)
            interrupted.add(f"run{n}/{len(done)}")
            temps = _temp_files(root)
            mid_commit += bool(temps)
            assert len(temps) <= 1, f"one killed writer leaves at most one temp file: {temps}"

            # A fresh, writable store: it would quarantine anything bad, so it must find nothing bad.
            store = Store(root)
            tag = _served(store.lookup_or_quarantine(key))
            assert store.rejected == 0 and not store.quarantine_dir.exists()
            # The entry before this run was valid and each replace is atomic, so it is never missing.
            if last_recovery is not None:
                assert tag is not None, f"kill {n}: a valid entry vanished"
            # Exactly the last commit that returned, or the one the kill interrupted after its replace.
            previous = done[-1] if done else last_recovery
            assert tag in (previous, f"run{n}/{len(done)}"), (n, tag, previous)

            # Recovery: the next writer commits and is served, temp files or not.
            last_recovery = f"recovery{n}"
            assert store.commit(key, artifact(last_recovery)) is not None
            committed.add(last_recovery)
            assert _served(Store(root).lookup_or_quarantine(key)) == last_recovery
            for t in temps:
                t.unlink()  # what a cleanup would do; keeps the one-temp-per-kill check exact
    finally:
        reader.stop.set()
        reader.join(10)
    assert reader.error is None, repr(reader.error)
    assert reader.store.rejected == 0, "a reader racing the writers was shown a damaged entry"
    assert reader.served - {None} <= committed | interrupted, reader.served - {None} - committed - interrupted
    elapsed = time.monotonic() - t_start
    print(f"\n{KILLS} kills in {elapsed:.1f} s, {mid_commit} left a commit half-done; reader: {reader.lookups} lookups, {len(reader.served)} distinct entries served")
    assert len(committed) > KILLS, "the driver must have committed between kills"


# --------------------------------------------------------------------------------------------
# A real engine start killed mid-compile
# --------------------------------------------------------------------------------------------


def _probe_report(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = proc.communicate(timeout=PROBE_TIMEOUT_S)
    assert proc.returncode == 0, err[-4000:]
    report: dict[str, Any] = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
    report["stderr"], report["cache_log"], report["real_compiles"] = split_stderr(err)
    return report


def _spawn(hook_dir: Path, root: Path, extra_env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "cute_diskcache._probe", "--target", TARGET, "--m", "1"]
    return subprocess.Popen(cmd, env=child_env(root, extra_env, hook_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=hook_dir)


def _held_by_someone(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # drops our flock if we got it
    return False


def test_engine_killed_mid_compile_then_next_start_recovers(compile_hook_dir: Path, warm_micro_root: Warm, tmp_path: Path) -> None:
    cold = warm_micro_root.cold
    [event] = cold["events"]
    lock = locking.lock_path(tmp_path / "root", event[1])
    root = tmp_path / "root"
    victim = _spawn(compile_hook_dir, root)
    try:
        deadline = time.monotonic() + PROBE_TIMEOUT_S
        while not _held_by_someone(lock):  # held from its miss until its commit: it is compiling
            assert victim.poll() is None and time.monotonic() < deadline, "the probe never started compiling"
            time.sleep(0.01)
        time.sleep(random.uniform(0.0, 0.5))  # a micro compile takes 1.6-2.4 s
        victim.send_signal(signal.SIGKILL)
        victim.wait()
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    assert not list(root.glob("v1/*/*/*/manifest.msgpack")), "killed mid-compile: nothing may be committed"
    assert not _held_by_someone(lock), "the kernel releases a dead holder's lock"

    after = _probe_report(_spawn(compile_hook_dir, root))
    assert after["real_compiles"] == 1 and after["stderr"] == ""
    c = after["counters"]
    assert (c["compiles"], c["writes"], c["rejected"], c["errors"], c["lock_waits"]) == (1, 1, 0, 0, 0)
    assert after["records"][0]["launch_error"] == cold["records"][0]["launch_error"]

    # The one after hits: what it would look up verifies, under the cold start's key.
    [cold_manifest] = [entry.read_manifest(m.parent) for m in warm_micro_root.root.glob("v1/*/*/*/" + entry.MANIFEST)]
    assert [m.parent.name for m in root.glob("v1/*/*/*/" + entry.MANIFEST)] == [event[1]]
    assert_next_start_would_hit(root, cold_manifest)
