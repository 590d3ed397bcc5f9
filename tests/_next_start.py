"""Whether the next start would hit an entry, judged in this process instead of in a fresh one.

A fresh probe that hits costs 8-9 s (its interpreter, torch, the DSL and flashinfer) to say one
thing: the entry under the key it computes verifies. Where a test has already shown, in a fresh
process, that a start computes the cold start's key and hits what verifies under it, the
entries its other cases rewrite through the same path are judged here, by the check every
lookup makes (:meth:`cute_diskcache.storage.store.Store.judge`), under that same key.

Nothing here imports flashinfer or the DSL.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from cute_diskcache.keys.key import Environment
from cute_diskcache.storage.store import Found, Store

#: What the rewrite must share with the cold start's entry: the same key, environment and
#: digest (so the same lookup finds it), and the same entry point.
SAME = ("digest", "key_bytes", "env_digest", "env", "symbol", "tvm_ffi")


def lookup_key(m: dict[str, Any]) -> Any:
    """The key a start looks ``m``'s kernel up with, from the manifest the cold start wrote.

    The environment is rebuilt as a real :class:`Environment`, so the entry's directory
    (namespace, digest) is derived, not copied; both digests are checked against the manifest.
    """
    e = m["env"]
    env = Environment(kind=e["kind"], package=e["package"], sources=e["sources"], arch=e["arch"],
                      dsl=tuple(map(tuple, e["dsl"])), codegen_env=tuple(map(tuple, e["codegen_env"])),
                      machine=e["machine"], device=e["device"])
    assert env.as_dict() == e and env.digest == m["env_digest"], "the manifest's environment, rebuilt"
    assert hashlib.sha256(bytes.fromhex(env.digest) + m["key_bytes"]).hexdigest() == m["digest"]
    return SimpleNamespace(env=env, key_bytes=m["key_bytes"], digest=m["digest"])


def _quarantined(root: Path) -> list[Path]:
    q = root / "quarantine"
    return sorted(q.iterdir()) if q.exists() else []


def assert_next_start_would_hit(root: Path, cold_manifest: dict[str, Any], same_payloads: bool = True) -> None:
    """The entry a start looks up under the cold start's key verifies, every payload against its
    checksum and then the one a hit loads, and is that kernel's; judging it moved nothing.

    ``same_payloads=False``: the rewrite ran under other settings (``CUTE_DISKCACHE_SHARED_OBJECTS=0``
    writes no linked shared object), so it holds some of the cold start's payloads, not all."""
    key = lookup_key(cold_manifest)
    before = _quarantined(root)
    store = Store(root)
    for load in (False, True):
        verdict = store.judge(key, load=load)
        assert isinstance(verdict, Found), f"the next start would not hit (load={load}): {verdict!r}"
        written = verdict[0]
        assert {k: written[k] for k in SAME} == {k: cold_manifest[k] for k in SAME}
        if same_payloads:
            assert sorted(written["payloads"]) == sorted(cold_manifest["payloads"]), "every payload the cold start wrote"
        else:
            assert written["payloads"] and set(written["payloads"]) <= set(cold_manifest["payloads"]), written["payloads"]
    assert store.rejected == 0 and _quarantined(root) == before
