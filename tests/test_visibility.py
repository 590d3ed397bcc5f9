"""Seeing the cache work in an engine that configured no logging (issue 20, item 3).

A serving process that attaches the cache says, on stderr and with no logging set up: one line
at attach (root, read-only or not, entries for this stack), one WARNING per compile naming the
site, the kernel and why it missed, and one summary line at exit. When the application has a
handler of its own (root's, or one on ``cute_diskcache``) the lines go through it, once; vLLM's
configuration (a handler on ``vllm`` only) leaves them to ours. ``CUTE_DISKCACHE_LOG_LEVEL``
turns them down or off.

The engine-like children are the conftest probes: flashinfer's real MoE wrapper through the
``rtx-pro-6000`` profile, real compiles counted by the DSL hook.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

FLASHINFER = importlib.metadata.version("flashinfer-python")
DSL = importlib.metadata.version("nvidia-cutlass-dsl")
SITE = "flashinfer.moe_dispatch.micro"


def _attach_line(root: Path, entries: str, on_miss: str = "compile") -> str:
    return (f"[cute-diskcache] INFO attached: cache {root} (writable), {entries} for this stack "
            f"(flashinfer {FLASHINFER}, DSL {DSL}, sm_120a, x86_64); on a miss: {on_miss}")


# --------------------------------------------------------------------------------------------
# The handler: ours only when nobody else's would show the record
# --------------------------------------------------------------------------------------------

_EMIT = """
import logging, sys
{setup}
from cute_diskcache import logsetup
logsetup.configure()
log = logging.getLogger("cute_diskcache")
log.info("attached: the info line")
log.warning("compiling the warning line")
"""


def _emit(setup: str, **env: str) -> subprocess.CompletedProcess[str]:
    import os

    child = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_")}
    child.update(env)
    return subprocess.run([sys.executable, "-c", _EMIT.format(setup=setup)], env=child, capture_output=True, text=True, timeout=60)


def test_no_logging_configured_prints_ours_on_stderr() -> None:
    proc = _emit("")
    assert proc.stderr.splitlines() == ["[cute-diskcache] INFO attached: the info line",
                                        "[cute-diskcache] WARNING compiling the warning line"]


def test_vllm_like_configuration_of_its_own_logger_only_leaves_ours_on() -> None:
    setup = ("h = logging.StreamHandler(sys.stdout); h.setFormatter(logging.Formatter('VLLM %(message)s'))\n"
             "v = logging.getLogger('vllm'); v.addHandler(h); v.propagate = False; v.setLevel(logging.INFO)")
    proc = _emit(setup)
    assert proc.stdout == "" and len(proc.stderr.splitlines()) == 2 and proc.stderr.startswith("[cute-diskcache] INFO ")


def test_root_handler_of_the_application_is_used_once() -> None:
    proc = _emit("logging.basicConfig(format='APP %(name)s %(levelname)s %(message)s')")
    assert proc.stderr.splitlines() == ["APP cute_diskcache INFO attached: the info line",
                                        "APP cute_diskcache WARNING compiling the warning line"]


def test_a_level_the_application_set_is_kept_and_the_setting_overrides_it() -> None:
    kept = _emit("logging.getLogger('cute_diskcache').setLevel(logging.WARNING)")
    assert kept.stderr.splitlines() == ["[cute-diskcache] WARNING compiling the warning line"]
    forced = _emit("logging.getLogger('cute_diskcache').setLevel(logging.WARNING)", CUTE_DISKCACHE_LOG_LEVEL="info")
    assert len(forced.stderr.splitlines()) == 2


@pytest.mark.parametrize("level, lines", [("warning", 1), ("error", 0), ("off", 0), ("OFF", 0), ("loud", 3)])
def test_log_level_setting(level: str, lines: int) -> None:
    proc = _emit("", CUTE_DISKCACHE_LOG_LEVEL=level)
    assert len(proc.stderr.splitlines()) == lines, proc.stderr
    if level == "loud":  # a typo keeps the default, and says so
        assert "ignoring CUTE_DISKCACHE_LOG_LEVEL='loud'" in proc.stderr


# --------------------------------------------------------------------------------------------
# Engine starts: cold, warm, a miss under another env switch, LOG_LEVEL=off
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cold_start_says_attach_why_it_compiled_and_a_summary(warm_micro_root: Any) -> None:
    cold = warm_micro_root.cold
    digest = cold["events"][0][1]
    attach, warning, summary = cold["cache_log"]
    assert attach == _attach_line(warm_micro_root.root, "0 entries")
    assert warning.startswith(f"[cute-diskcache] WARNING compiling {SITE} kernel {digest[:12]}: no entry for this kernel; "
                              "key ('compile', 'fused_moe/cute_dsl/blackwell_sm12x/moe_dispatch.py:_get_micro_kernel', '_get_micro_kernel', "), warning
    assert re.fullmatch(rf"\[cute-diskcache\] INFO this process: 1 miss, 1 compiled in \d+\.\d s; cache {re.escape(str(warm_micro_root.root))}",
                        summary), summary
    assert cold["stderr"] == "" and cold["real_compiles"] == 1


@pytest.mark.slow
def test_warm_start_says_attach_with_the_entry_and_the_hit(micro_copy: Any, probe: Any) -> None:
    warm = probe(micro_copy.root, 1)
    assert warm["real_compiles"] == 0 and warm["stderr"] == ""
    attach, summary = warm["cache_log"]
    assert attach == _attach_line(micro_copy.root, "1 entry")
    assert re.fullmatch(r"\[cute-diskcache\] INFO this process: 1 hit, \d+\.\d s of compiles saved \(\d+ ms loading\); cache .*", summary), summary


@pytest.mark.slow
def test_miss_under_another_env_switch_names_the_switch(micro_copy: Any, probe: Any) -> None:
    """The entry was made with the variable unset; this engine sets a DSL variable the key reads."""
    other = probe(micro_copy.root, 1, extra_env={"CUTE_DSL_CDC_VISIBILITY_SWITCH": "1"})
    assert other["real_compiles"] == 1
    (warning,) = [ln for ln in other["cache_log"] if " WARNING " in ln]
    assert warning.startswith(f"[cute-diskcache] WARNING compiling {SITE} kernel "), warning
    assert ": this kernel's entry was made under another stack; it differs in: env switch CUTE_DSL_CDC_VISIBILITY_SWITCH unset -> 1; " in warning


@pytest.mark.slow
def test_log_level_off_says_nothing_even_when_compiling(micro_copy: Any, compile_hook_dir: Path) -> None:
    from conftest import TARGET, child_env

    env = child_env(micro_copy.root, {"CUTE_DISKCACHE_LOG_LEVEL": "off", "CUTE_DSL_CDC_VISIBILITY_SWITCH": "2"}, compile_hook_dir)
    proc = subprocess.run([sys.executable, "-m", "cute_diskcache._probe", "--target", TARGET, "--m", "1"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=compile_hook_dir)
    assert proc.returncode == 0
    assert proc.stderr == "cdc-test real compiles: 1\n", proc.stderr  # the test's own counter, and nothing of ours


def test_attach_line_says_read_only_for_a_root_it_cannot_create(tmp_path: Path) -> None:
    """A root not made yet on a read-only mount was announced "writable", then the first miss
    warned that it could not write: the attach line asks the nearest existing level."""
    from cute_diskcache.core import report
    from cute_diskcache.storage.store import Store

    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(ro)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    try:
        assert report._access(Store(ro / "cache")) == f"read-only: cannot create it in {ro}"
        assert report._access(Store(tmp_path / "rw" / "cache")) == "writable"
    finally:
        subprocess.run(["umount", str(ro)], check=True)
