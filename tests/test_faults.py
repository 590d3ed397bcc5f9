"""A cache that cannot be written: one warning, kernels from memory, no request fails.

Made real, not simulated: we run as root here, and chmod does not stop root, so a read-only
root is a read-only bind mount and a full disk is a tiny tmpfs, both inside a private mount
namespace (``unshare -rm``) that vanishes with the probe. RLIMIT_FSIZE and a root under a
regular file need no namespace.
"""

from __future__ import annotations

import re
import resource
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import pytest

if TYPE_CHECKING:
    from conftest import Warm

Probe = Callable[..., dict[str, Any]]
_CANNOT_WRITE = re.compile(r"^cute-diskcache cannot write to .*$", re.M)


@pytest.fixture(scope="module")
def mount_ns(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., list[str]]:
    """``mount_ns(setup, keep_shell=False)`` -> a command prefix running ``setup`` (sh) in a private mount namespace.

    Skips the module when this machine does not let us make one (no unshare, no user
    namespaces, or mounts refused inside them).
    """
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed: cannot make a private mount namespace")
    spot = tmp_path_factory.mktemp("mount-check")
    check = subprocess.run(
        ["unshare", "-rm", "sh", "-ec", f"mount -t tmpfs -o size=64k tmpfs {spot} && mount -o remount,ro {spot}"],
        capture_output=True,
        text=True,
    )
    if check.returncode != 0:
        pytest.skip(f"private mount namespaces are not permitted here: {check.stderr.strip()}")

    def prefix(setup: str, *, keep_shell: bool = False) -> list[str]:
        run = '"$@"' if keep_shell else 'exec "$@"'  # keep_shell: an EXIT trap must still run
        return ["unshare", "-rm", "sh", "-ec", f"{setup}\n{run}", "sh"]

    return prefix


def _read_only(path: Path) -> str:
    p = shlex.quote(str(path))
    return f"mount --bind {p} {p} && mount -o remount,bind,ro {p}"


def _assert_kernel_works(report: dict[str, Any], cold: dict[str, Any], kernels: int = 1) -> None:
    """Compiled in memory, served to flashinfer; m=1's kernel has the ABI of a normal cold start."""
    assert report["real_compiles"] == kernels, report["stderr"]
    assert report["counters"]["compiles"] == kernels and report["counters"]["writes"] == 0
    assert report["kernels"] == {**cold["kernels"], "micro": kernels}
    assert report["records"][0]["m"] == 1 == cold["records"][0]["m"]
    assert report["records"][0]["launch_error"] == cold["records"][0]["launch_error"]


def _assert_one_warning(report: dict[str, Any], why: str) -> None:
    warnings = _CANNOT_WRITE.findall(report["stderr"])
    assert len(warnings) == 1 and why in warnings[0], report["stderr"]
    assert report["stderr"].strip() == warnings[0], f"nothing but that one warning expected:\n{report['stderr']}"
    assert report["counters"]["writable"] is False
    assert report["counters"]["rejected"] == 0 and report["counters"]["errors"] == 0


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_read_only_root_still_serves_hits(micro_copy: Warm, probe: Probe, mount_ns: Callable[..., list[str]]) -> None:
    root, cold = micro_copy
    before = _files(root)
    report = probe(root, 1, prefix=mount_ns(_read_only(root)))
    assert report["real_compiles"] == 0, report["stderr"]
    assert (report["counters"]["hits"], report["counters"]["compiles"]) == (1, 0)
    assert report["records"][0]["launch_error"] == cold["records"][0]["launch_error"]
    assert report["stderr"] == ""
    assert _files(root) == before


def test_empty_read_only_root_compiles_in_memory(
    warm_micro_root: Warm, probe: Probe, mount_ns: Callable[..., list[str]], tmp_path: Path
) -> None:
    root = tmp_path / "ro-root"
    root.mkdir()
    report = probe(root, 1, prefix=mount_ns(_read_only(root)))
    _assert_kernel_works(report, warm_micro_root.cold)
    _assert_one_warning(report, "read-only filesystem")
    assert _files(root) == []


@pytest.mark.parametrize(
    "size",
    [
        pytest.param("64k", id="nothing-fits"),
        # Room for the 126 KiB object but not the cubin after it: a payload lands, the commit never does.
        pytest.param("160k", id="object-fits"),
    ],
)
def test_full_disk_leaves_no_entry(
    warm_micro_root: Warm, probe: Probe, mount_ns: Callable[..., list[str]], tmp_path: Path, size: str
) -> None:
    root = tmp_path / "tiny"
    root.mkdir()
    # The probe reports after its writes; list the tmpfs before the namespace (and it) goes away.
    listing = tmp_path / "listing.txt"
    q = shlex.quote
    # mode=0755: a fresh tmpfs is 1777, and the cache rightly refuses a root anyone can write.
    setup = f"mount -t tmpfs -o size={size},mode=0755 tmpfs {q(str(root))}\ntrap 'find {q(str(root))} -type f > {q(str(listing))}' EXIT"
    report = probe(root, 1, prefix=mount_ns(setup, keep_shell=True))
    _assert_kernel_works(report, warm_micro_root.cold)
    _assert_one_warning(report, "disk full")
    left = listing.read_text().split()
    assert not [f for f in left if f.endswith("manifest.msgpack")], left
    assert not [f for f in left if "/.tmp." in f], f"temp files left behind: {left}"
    assert _files(root) == [], "the tmpfs must not have leaked out of the namespace"


def test_file_size_limit(warm_micro_root: Warm, probe: Probe, tmp_path: Path) -> None:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, 50_000))

    root = tmp_path / "root"
    # Two kernels (m=1, m=2): the warning is once per process, not once per kernel.
    report = probe(root, 1, 2, preexec_fn=limit)
    _assert_kernel_works(report, warm_micro_root.cold, kernels=2)
    _assert_one_warning(report, "file size limit")
    assert not list(root.rglob("manifest.msgpack"))


def test_uncreatable_root(warm_micro_root: Warm, probe: Probe, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    report = probe(blocker / "cache", 1, 2)  # two lookups, two misses: still one warning
    _assert_kernel_works(report, warm_micro_root.cold, kernels=2)
    _assert_one_warning(report, "Not a directory")
    assert blocker.read_text() == "not a directory"


# --------------------------------------------------------------------------------------------
# A full disk recovers; an unusable /tmp does not stop persistence (issue 15, item 8)
# --------------------------------------------------------------------------------------------


def test_full_disk_evicts_and_the_commit_lands(
    warm_micro_root: Warm, probe: Probe, mount_ns: Callable[..., list[str]], tmp_path: Path
) -> None:
    """Old code: ENOSPC turned writes off for the process before eviction ran, so a volume the
    cache itself filled stayed full and nothing was persisted until someone ran ``evict``."""
    root = tmp_path / "tiny"
    root.mkdir()
    listing = tmp_path / "listing.txt"
    q = shlex.quote
    # Room for the m=1 entry already there (~310 KB) and the new one's export, not for both entries.
    setup = (f"mount -t tmpfs -o size=450k,mode=0755 tmpfs {q(str(root))}\n"
             f"cp -a {q(str(warm_micro_root.root))}/v1 {q(str(root))}/v1\n"
             f"find {q(str(root))}/v1 -mindepth 3 -maxdepth 3 -type d -exec touch -d '2 hours ago' {{}} +\n"  # last used a while ago
             f"trap 'find {q(str(root))} -name manifest.msgpack > {q(str(listing))}' EXIT")
    report = probe(root, 2, prefix=mount_ns(setup, keep_shell=True), extra_env={"CUTE_DISKCACHE_MAX_SIZE": "0"})
    c = report["counters"]
    assert report["real_compiles"] == 1 and (c["compiles"], c["writes"], c["errors"]) == (1, 1, 0), report["stderr"]
    assert "cannot write" not in report["stderr"] and "was full; freed" in report["stderr"], report["stderr"]
    old_digest = warm_micro_root.cold["events"][0][1]
    left = listing.read_text().split()
    assert len(left) == 1 and old_digest not in left[0], left  # the least recently used entry made room


_PROBE_WITH_SMALL_TMP = (
    "import runpy, sys, tempfile, cute_diskcache\n"
    "cute_diskcache.install(target='rtx-pro-6000')\n"
    "import flashinfer.fused_moe.cute_dsl.blackwell_sm12x.moe_dispatch\n"
    "from flashinfer.cute_dsl.utils import current_cuda_stream\n"
    "current_cuda_stream()  # torch._dynamo's cache dir: made while /tmp still had room\n"
    "tempfile.tempdir = sys.argv.pop(1)\n"
    "runpy.run_module('cute_diskcache._probe', run_name='__main__', alter_sys=True)\n"
)


def test_small_tmp_does_not_stop_persistence(
    warm_micro_root: Warm, compile_hook_dir: Path, mount_ns: Callable[..., list[str]], tmp_path: Path
) -> None:
    """The DSL's exporter writes the ~130 KB object through ``tempfile``: with a small (or full,
    or read-only) temporary directory old code lost every entry, with a warning blaming the
    cache root. Now the export is staged inside the root."""
    import json
    import subprocess
    import sys

    from conftest import child_env

    root, small = tmp_path / "root", tmp_path / "small-tmp"
    small.mkdir()
    prefix = mount_ns(f"mount -t tmpfs -o size=64k,mode=0755 tmpfs {shlex.quote(str(small))}")
    cmd = [*prefix, sys.executable, "-c", _PROBE_WITH_SMALL_TMP, str(small), "--target", "rtx-pro-6000", "--m", "1"]
    proc = subprocess.run(cmd, env=child_env(root, None, compile_hook_dir), capture_output=True, text=True, timeout=300, cwd=compile_hook_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    assert report["records"][0]["launch_error"] == warm_micro_root.cold["records"][0]["launch_error"]
    assert report["counters"]["writes"] == 1 and report["counters"]["writable"] is True, proc.stderr
    assert "cannot write" not in proc.stderr
    assert [p.parent.name for p in root.glob("v1/*/*/*/manifest.msgpack")] == [warm_micro_root.cold["events"][0][1]]
    assert not list((root / "tmp").iterdir()), "the scratch space is cleaned up"
