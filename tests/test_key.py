"""Keys: two compiles that could differ must never share an entry, and equal ones must meet.

A collision serves a wrong kernel, the one failure a cache must never have; a spurious
difference (hash seed, dict order, install path) only costs a miss, but costs it on every
engine start. Python's ``==`` is no guide here: ``1 == True == 1.0`` and ``0.0 == -0.0``.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import math
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _helpers, whatever pytest's import mode

from _helpers import OPTIONS, SITE_FIELDS, SITE_KEYS, make_env, make_key  # noqa: E402

from cute_diskcache.keys import key as keymod  # noqa: E402
from cute_diskcache.keys.key import CacheKey, UnkeyableError, codegen_env, encode, source_fingerprint  # noqa: E402


# --------------------------------------------------------------------------------------------
# Canonical encoding
# --------------------------------------------------------------------------------------------


class Float4E2M1FN:
    """Stands in for a cutlass numeric type: key elements that are classes."""


class Float8E4M3FN:
    """A second cutlass-like type."""


def _same_name_other_module() -> type:
    cls = type("Float4E2M1FN", (), {})
    cls.__module__ = "other.numeric"
    cls.__qualname__ = Float4E2M1FN.__qualname__
    return cls


class Precision(enum.IntEnum):
    FP4 = 1


def _nan(hex_bits: str) -> float:
    return struct.unpack(">d", bytes.fromhex(hex_bits))[0]


#: Values that must all encode differently, most of them equal under ``==`` to another one.
DISTINCT: list[tuple[str, Any]] = [
    ("int 1", 1),
    ("True", True),
    ("float 1.0", 1.0),
    ("int 0", 0),
    ("False", False),
    ("0.0", 0.0),
    ("-0.0", -0.0),
    ("1.5", 1.5),
    ("-1.5", -1.5),
    ("1.702", 1.702),
    ("nextafter(1.702)", math.nextafter(1.702, math.inf)),
    ("inf", math.inf),
    ("-inf", -math.inf),
    ("nan", math.nan),
    ("None", None),
    ("'None'", "None"),
    ("''", ""),
    ("b''", b""),
    ("'ab'", "ab"),
    ("b'ab'", b"ab"),
    ("()", ()),
    ("[]", []),
    ("{}", {}),
    ("frozenset()", frozenset()),
    ("(1, 2)", (1, 2)),
    ("[1, 2]", [1, 2]),
    ("(1, (2, 3))", (1, (2, 3))),
    ("((1, 2), 3)", ((1, 2), 3)),
    ("(1, 2, 3)", (1, 2, 3)),
    ("((1,),)", ((1,),)),
    ("(1,)", (1,)),
    ("('a', 'b')", ("a", "b")),
    ("('ab',)", ("ab",)),
    ("{'a': 1}", {"a": 1}),
    ("(('a', 1),)", (("a", 1),)),
    ("{1: 2}", {1: 2}),
    ("{'1': 2}", {"1": 2}),
    ("frozenset({1})", frozenset({1})),
    ("2**63 - 1", 2**63 - 1),
    ("2**63", 2**63),
    ("2**64", 2**64),
    ("'18446744073709551616'", str(2**64)),
    ("-(2**63)", -(2**63)),
    ("-(2**63) - 1", -(2**63) - 1),
    ("torch.int32", torch.int32),
    ("torch.int64", torch.int64),
    ("'torch.int32'", "torch.int32"),
    ("Float4E2M1FN", Float4E2M1FN),
    ("Float8E4M3FN", Float8E4M3FN),
    ("other.numeric.Float4E2M1FN", _same_name_other_module()),
    ("IntEnum FP4 (== 1)", Precision.FP4),
]


def test_tricky_values_encode_pairwise_distinct() -> None:
    encoded: dict[bytes, str] = {}
    collisions = []
    for label, value in DISTINCT:
        blob = encode(value)
        if blob in encoded:
            collisions.append((encoded[blob], label))
        encoded.setdefault(blob, label)
    assert not collisions


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (1, True),
        (1, 1.0),
        (0.0, -0.0),
        (1.5, -1.5),
        (None, "None"),
        ((1, 2), [1, 2]),
        ((1, (2, 3)), ((1, 2), 3)),
        ("x", b"x"),
        (torch.int32, torch.int64),
        (Float4E2M1FN, Float8E4M3FN),
    ],
    ids=repr,
)
def test_named_pairs_differ(a: Any, b: Any) -> None:
    """The pairs the issue names, one by one, so a failure says which."""
    assert encode(a) != encode(b)


def test_equal_values_encode_identically() -> None:
    """Encoding is a function of the value: fresh but equal objects give the same bytes."""
    for _label, value in DISTINCT:
        assert encode(value) == encode(_rebuild(value))


def _rebuild(value: Any) -> Any:
    if isinstance(value, tuple):
        return tuple(_rebuild(v) for v in value)
    if isinstance(value, list):
        return [_rebuild(v) for v in value]
    if isinstance(value, dict):
        return {_rebuild(k): _rebuild(v) for k, v in reversed(list(value.items()))}
    if isinstance(value, str):
        return "".join(list(value))
    if isinstance(value, float) and not math.isnan(value):
        return struct.unpack(">d", struct.pack(">d", value))[0]
    return value


def test_every_nan_is_one_nan() -> None:
    nans = [
        math.nan,
        -math.nan,
        float("nan"),
        _nan("7ff8000000000001"),  # quiet, payload 1
        _nan("7ff0000000000001"),  # signalling
        _nan("fff8000000000000"),  # negative
        _nan("ffffffffffffffff"),  # all ones
        _nan("7ff8deadbeef0000"),
        float(torch.tensor(float("nan"))),
    ]
    assert all(math.isnan(v) for v in nans)
    # The inputs really carry different bits, so the test means something.
    assert len({struct.pack(">d", v) for v in nans}) >= 6
    assert len({encode(v) for v in nans}) == 1
    assert encode((1, math.nan)) == encode((1, _nan("7ff8deadbeef0000")))
    assert encode(math.nan) not in {encode(math.inf), encode(0.0), encode(None)}


def test_dict_order_does_not_matter() -> None:
    a = {"k": 2048, "n": 768, "tiler": (128, 128), 3: None}
    b = {3: None, "tiler": (128, 128), "n": 768, "k": 2048}
    assert list(a) != list(b)
    assert encode(a) == encode(b)
    assert encode(("outer", a)) == encode(("outer", b))
    assert encode(a) != encode({**a, "n": 769})


def test_encoding_does_not_depend_on_hash_seed() -> None:
    """Sets and dicts must not leak the process's string hash order into the bytes."""
    code = textwrap.dedent(
        """
        from cute_diskcache.keys.key import encode
        value = (frozenset({"alpha", "beta", "gamma", "delta", "eps"}), {"z": 1, "y": 2, "x": {"q", "r", "s"}})
        print(encode(value).hex())
        """
    )
    outputs = set()
    for seed in ("1", "2", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        outputs.add(out.stdout.strip())
    assert len(outputs) == 1
    assert outputs.pop() == encode(
        (frozenset({"alpha", "beta", "gamma", "delta", "eps"}), {"z": 1, "y": 2, "x": {"q", "r", "s"}})
    ).hex()


def test_torch_dtypes_encode_by_name() -> None:
    dtypes = [torch.int32, torch.int64, torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn]
    assert len({encode(d) for d in dtypes}) == len(dtypes)
    assert encode(torch.int32) == encode(getattr(torch, "int32"))


def test_cutlass_like_types_encode_by_qualified_name() -> None:
    assert encode(Float4E2M1FN) == encode(Float4E2M1FN)
    assert encode(Float4E2M1FN) != encode(_same_name_other_module())
    assert encode(Float4E2M1FN) != encode(f"{Float4E2M1FN.__module__}.{Float4E2M1FN.__qualname__}")


@pytest.mark.parametrize(
    "value",
    [
        object(),
        lambda: 1,
        torch.zeros(2),
        bytearray(b"x"),
        1j,
        Float4E2M1FN(),  # an instance, not the type
        (1, object()),
        [1, (2, {"a": object()})],
        {object(): 1},
        frozenset({object()}),
    ],
    ids=lambda v: type(v).__name__,
)
def test_unsupported_objects_raise_unkeyable(value: Any) -> None:
    with pytest.raises(UnkeyableError):
        encode(value)


# --------------------------------------------------------------------------------------------
# Plain: the hook's key tree, written by marshal in one C call (issue 22, the hit path)
# --------------------------------------------------------------------------------------------

#: Pairs Python calls equal (or that print alike) which must never share a key.
_PLAIN_PAIRS = [
    (True, 1), (False, 0), (1, 1.0), (0.0, -0.0), ("a", b"a"), ((), None), ((1,), [1]),
    (("a", ("b",)), (("a", "b"),)), (2**70, str(2**70)), (2**70, 2**70 + 1), ("1", 1), ((None,), (None, None)),
]


@pytest.mark.parametrize(("a", "b"), _PLAIN_PAIRS, ids=[f"{a!r}-vs-{b!r}" for a, b in _PLAIN_PAIRS])
def test_plain_keeps_apart_what_compares_equal(a: Any, b: Any) -> None:
    assert keymod.Plain(("k", a)).data != keymod.Plain(("k", b)).data


def test_plain_bytes_do_not_depend_on_sharing_or_interning() -> None:
    """marshal format 2 writes no back-references: a tree holding one string twice, or an interned
    string, gives the bytes of the same tree built from copies (format 3 and later would not, and
    one kernel would get a different key from every code path that built its key)."""
    shared = "".join(["tile", "_shape"])
    copy = "".join(["tile_", "shape"])
    assert shared is not copy
    once = keymod.Plain((shared, (shared, 128)))
    twice = keymod.Plain((copy, ("".join(["ti", "le_shape"]), 128)))
    interned = keymod.Plain((sys.intern("tile_shape"), (sys.intern("tile_shape"), 128)))
    assert once.data == twice.data == interned.data


@pytest.mark.parametrize("value", [enum.IntEnum("E", "A").A, type("S", (str,), {})("x"), type("I", (int,), {})(3)],
                         ids=["int-enum", "str-subclass", "int-subclass"])
def test_plain_refuses_every_type_but_the_exact_built_ins(value: Any) -> None:
    """A subclass of ``int`` or ``str`` would be written as its base by a lossy encoder: refused."""
    with pytest.raises(UnkeyableError):
        keymod.Plain(("k", value))


def test_plain_bytes_are_the_same_in_another_process() -> None:
    code = "from cute_diskcache.keys.key import Plain; print(Plain(('compile', ('a', -0.0, 2**70, True, None, b'x'))).data.hex())"
    outputs = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                              capture_output=True, text=True, check=True).stdout.strip() for seed in ("1", "2")}
    assert outputs == {keymod.Plain(("compile", ("a", -0.0, 2**70, True, None, b"x"))).data.hex()}


def test_a_plain_key_never_shares_bytes_with_the_tagged_tree() -> None:
    tree = ("compile", "f.py:site", ("args", (1, "x")))
    plain = CacheKey(make_env(), "site", keymod.Plain(tree), OPTIONS)
    tagged = CacheKey(make_env(), "site", tree, OPTIONS)
    assert plain.digest != tagged.digest
    assert repr(plain.site_key) == repr(tree) and keymod.Plain(tree) == keymod.Plain(tree)


def test_unkeyable_is_a_type_error() -> None:
    """cached_compile documents TypeError for unsupported key elements."""
    assert issubclass(UnkeyableError, TypeError)


def _nest(depth: int, kind: str) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"t": (value,), "l": [value], "d": {"k": value}}[kind]
    return value


@pytest.mark.parametrize("kind", ["t", "l", "d"])
def test_depth_limit(kind: str) -> None:
    # Anything the tagger accepts must also pack (msgpack has its own nesting limit).
    assert encode(_nest(60, kind))
    with pytest.raises(UnkeyableError):
        encode(_nest(200, kind))


def test_self_referencing_key_is_unkeyable_not_recursion_error() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    with pytest.raises(UnkeyableError):
        encode(loop)


# --------------------------------------------------------------------------------------------
# Key sensitivity: any element of any site key, and every part of the environment
# --------------------------------------------------------------------------------------------

_STR_ALTERNATIVES = {"silu": "relu2", "fp4": "fp8", "micro": "static", "static": "dynamic", "dynamic": "micro"}


def _variants(value: Any) -> list[tuple[str, Any]]:
    """Values of the same role that differ from ``value``, including ones equal under ``==``."""
    if isinstance(value, bool):
        return [("not", not value), ("as int", int(value))]
    if isinstance(value, int):
        out = [("+1", value + 1), ("-1", value - 1), ("as float", float(value))]
        if value in (0, 1):
            out.append(("as bool", bool(value)))
        return out
    if isinstance(value, float):
        out = [("negated", -value), ("next float", math.nextafter(value, math.inf))]
        if value.is_integer():
            out.append(("as int", int(value)))
        return out
    if value is None:
        return [("7.0", 7.0), ("0.0", 0.0), ("'None'", "None")]
    if isinstance(value, str):
        return [("alternative", _STR_ALTERNATIVES.get(value, value + "x")), ("suffixed", value + "x")]
    if isinstance(value, tuple):
        return [("halved n", (value[0], value[1] // 2)), ("as list", list(value)), ("longer", value + (1,))]
    if isinstance(value, torch.dtype):
        return [("other dtype", torch.int64 if value != torch.int64 else torch.int32), ("as str", str(value))]
    raise AssertionError(f"no variants for {value!r}")


def _site_cases() -> Iterator[Any]:
    for kind, site_key in SITE_KEYS.items():
        assert len(site_key) == len(SITE_FIELDS[kind])
        for index, (field_name, value) in enumerate(zip(SITE_FIELDS[kind], site_key)):
            for label, new in _variants(value):
                yield pytest.param(kind, index, new, id=f"{kind}-{index}-{field_name}-{label}")


@pytest.mark.parametrize(("kind", "index", "new"), list(_site_cases()))
def test_changing_any_site_key_element_changes_digest(kind: str, index: int, new: Any) -> None:
    base = make_key(kind)
    changed = list(SITE_KEYS[kind])
    changed[index] = new
    other = make_key(kind, site_key=tuple(changed))
    assert other.key_bytes != base.key_bytes
    assert other.digest != base.digest


@pytest.mark.parametrize("kind", list(SITE_KEYS))
def test_all_single_element_changes_are_pairwise_distinct(kind: str) -> None:
    """Not only different from the base: no two mutations of one key collide either."""
    digests = {make_key(kind).digest}
    count = 1
    for index, value in enumerate(SITE_KEYS[kind]):
        for _label, new in _variants(value):
            changed = list(SITE_KEYS[kind])
            changed[index] = new
            digests.add(make_key(kind, site_key=tuple(changed)).digest)
            count += 1
    assert len(digests) == count


def _kernel_object(kind: str, values: tuple[Any, ...]) -> Any:
    """A flashinfer kernel object (by module) holding one kind's key fields as its state."""
    cls = type(f"{kind.title()}Kernel", (), {})
    cls.__module__ = "flashinfer._cdc_keytest"
    obj = cls()
    vars(obj).update(zip(SITE_FIELDS[kind], values))
    return obj


def _hook_key(kind: str, values: tuple[Any, ...]) -> CacheKey:
    from cute_diskcache.core import hook

    return make_key(kind, site_key=("compile", "moe_dispatch.py:site", "site", ("args", hook.describe(_kernel_object(kind, values)))))


@pytest.mark.parametrize("kind", list(SITE_KEYS))
def test_the_hooks_description_keeps_every_kernel_attribute_apart(kind: str) -> None:
    """Issue 22: sites are keyed by what the compile receives (a kernel object: its whole state),
    not by a hand-written tuple. Every single-field change of a kernel object's state, including
    values equal under ``==``, is another digest, and no two collide."""
    base = _hook_key(kind, SITE_KEYS[kind])
    assert _hook_key(kind, tuple(SITE_KEYS[kind])).digest == base.digest
    digests = {base.digest}
    count = 1
    for index, value in enumerate(SITE_KEYS[kind]):
        for _label, new in _variants(value):
            changed = list(SITE_KEYS[kind])
            changed[index] = new
            digests.add(_hook_key(kind, tuple(changed)).digest)
            count += 1
    assert len(digests) == count


def test_same_inputs_same_digest() -> None:
    a, b = make_key("static"), make_key("static", env=make_env(), site_key=tuple(SITE_KEYS["static"]))
    assert a is not b and a.digest == b.digest and a.env.namespace == b.env.namespace
    assert len(a.digest) == 64 and int(a.digest, 16) >= 0


def test_site_key_length_and_site_name_matter() -> None:
    base = make_key("dynamic")
    assert make_key("dynamic", site_key=SITE_KEYS["dynamic"][:-1]).digest != base.digest
    assert make_key("dynamic", site_key=SITE_KEYS["dynamic"] + (None,)).digest != base.digest
    other_site = CacheKey(base.env, "flashinfer.moe_dispatch.static", base.site_key, base.options)
    assert other_site.digest != base.digest
    # The three kinds' keys differ from each other too.
    assert len({make_key(kind).digest for kind in SITE_KEYS}) == 3


@pytest.mark.parametrize(
    "changes",
    [
        {"arch": "sm_121a"},
        {"arch": "sm_120f"},
        {"arch": "sm_100a"},
        {"dsl": (("apache-tvm-ffi", "0.1.15.post2"), ("nvidia-cutlass-dsl", "4.6.3"), ("nvidia-cutlass-dsl-libs-base", "4.8.1"))},
        {"dsl": (("apache-tvm-ffi", "0.1.15.post2"), ("nvidia-cutlass-dsl", "4.8.1"), ("nvidia-cutlass-dsl-libs-base", "4.8.2"))},
        {"dsl": (("apache-tvm-ffi", "0.1.16"), ("nvidia-cutlass-dsl", "4.8.1"), ("nvidia-cutlass-dsl-libs-base", "4.8.1"))},
        {"dsl": (("nvidia-cutlass-dsl", "4.8.1"), ("nvidia-cutlass-dsl-libs-base", "4.8.1"))},
        {
            "dsl": (
                ("apache-tvm-ffi", "0.1.15.post2"),
                ("nvidia-cutlass-dsl", "4.8.1"),
                ("nvidia-cutlass-dsl-libs-base", "4.8.1"),
                ("nvidia-cutlass-dsl-libs-cu13", "4.8.1"),
            )
        },
        {"codegen_env": (("CUTE_DSL_COMPILER_OPT", "-O3"),)},
        {"codegen_env": (("CUTE_DSL_ENABLE_ASSERTIONS", "1"),)},
        {"machine": "aarch64"},
        {"package": "flashinfer-python==0.6.16"},
        {"package": "flashinfer-python==0.6.15"},
        {"sources": "6" * 64},
        {"kind": "generic"},
    ],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items())[:80],
)
def test_environment_changes_change_digest(changes: dict[str, Any]) -> None:
    base = make_key("micro")
    env = dataclasses.replace(base.env, **changes)
    other = make_key("micro", env=env)
    assert env.digest != base.env.digest
    assert env.namespace != base.env.namespace
    assert other.digest != base.digest
    assert other.key_bytes == base.key_bytes  # the difference is the environment's alone


@pytest.mark.parametrize("options", [None, "", "--opt-level 3 --enable-tvm-ffi", "--opt-level 2", ("--opt-level 2", "--enable-tvm-ffi")])
def test_compile_options_change_digest(options: Any) -> None:
    assert make_key("static", options=options).digest != make_key("static", options=OPTIONS).digest


def test_namespace_is_one_safe_path_component() -> None:
    env = make_env(kind="a/b", package="evil==../../x y", arch="sm_120a/..", machine="x\\86")
    ns = env.namespace
    assert "/" not in ns and "\\" not in ns and " " not in ns and ns not in (".", "..")
    assert ns.endswith(env.digest[:12])
    assert make_env().namespace.startswith("flashinfer-moe-0.6.15.post1-sm_120a-x86_64-")


# --------------------------------------------------------------------------------------------
# Environment capture
# --------------------------------------------------------------------------------------------


def test_codegen_env_keeps_codegen_vars_only() -> None:
    environ = {
        "CUTE_DSL_COMPILER_OPT": "-O3",
        "CUTE_DSL_SOME_FUTURE_KNOB": "1",  # unknown: keyed (a miss, never a wrong kernel)
        "CUTE_DSL_LOG_LEVEL": "10",
        "CUTE_DSL_ARCH": "sm_120a",  # keyed as Environment.arch instead
        "CUTE_DSL_CACHE_DIR": "/tmp/x",
        "PATH": "/usr/bin",
        "FLASHINFER_B12X_DISK_CACHE": "1",
    }
    assert codegen_env(environ) == {"CUTE_DSL_COMPILER_OPT": "-O3", "CUTE_DSL_SOME_FUTURE_KNOB": "1"}
    assert list(codegen_env(environ)) == sorted(codegen_env(environ))


@pytest.mark.parametrize("name", sorted(keymod._NON_CODEGEN_DSL_ENV))
def test_non_codegen_vars_do_not_change_codegen_env(name: str) -> None:
    base = {"CUTE_DSL_COMPILER_OPT": "-O2"}
    assert codegen_env({**base, name: "1"}) == codegen_env(base)


def test_environment_defaults_follow_process_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("CUTE_DSL_"):
            monkeypatch.delenv(name)

    def env_digest() -> str:
        return keymod.Environment(kind="flashinfer-moe", package="p==1", sources="s", arch="sm_120a").digest

    plain = env_digest()
    monkeypatch.setenv("CUTE_DSL_LOG_LEVEL", "10")
    monkeypatch.setenv("CUTE_DSL_KEEP_PTX", "1")
    assert env_digest() == plain
    monkeypatch.setenv("CUTE_DSL_COMPILER_OPT", "-O3")
    assert env_digest() != plain


def test_dsl_stack_lists_installed_dsl_and_tvm_ffi() -> None:
    import importlib.metadata

    stack = dict(keymod.dsl_stack())
    assert stack["nvidia-cutlass-dsl"] == importlib.metadata.version("nvidia-cutlass-dsl")
    assert stack["apache-tvm-ffi"] == importlib.metadata.version("apache-tvm-ffi")
    assert all(n.startswith("nvidia-cutlass-dsl") or n == "apache-tvm-ffi" for n in stack)
    assert keymod.dsl_stack_string() == ",".join(f"{n}=={v}" for n, v in keymod.dsl_stack())


def test_current_arch_follows_cute_dsl_arch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_121a")
    assert keymod.current_arch() == "sm_121a"


# --------------------------------------------------------------------------------------------
# source_fingerprint: content and module names, never paths
# --------------------------------------------------------------------------------------------

PKG = "cdc_fp_tinypkg"

#: kernel.py reaches helpers (a function), deep (through helpers' class), consts (a module
#: global), the package root (a function defined in __init__) and sub/__init__.py (a function
#: defined there). unrelated.py and sub/noise.py are imported by other code, or not, and
#: reached by nothing.
TINY_PKG: dict[str, str] = {
    "__init__.py": "def root_helper():\n    return 1\n",
    "kernel.py": (
        f"import os\n"
        f"from {PKG}.helpers import helper\n"
        f"from {PKG} import consts\n"
        f"from {PKG} import root_helper\n"
        f"from {PKG}.sub import sub_helper\n"
        f"def kernel():\n    return helper(), consts.X, root_helper(), sub_helper()\n"
    ),
    "helpers.py": f"from {PKG}.deep import Deep\ndef helper():\n    return Deep()\n",
    "deep.py": 'class Deep:\n    tag = "a"\n',
    "consts.py": "X = 1\n",
    "sub/__init__.py": "def sub_helper():\n    return 1\n",
    "sub/noise.py": "Z = 1\n",
    "unrelated.py": "Y = 1\n",
}

#: Modules other code in the process may or may not have imported before the fingerprint.
UNREACHED = (f"{PKG}.unrelated", f"{PKG}.sub.noise")


def _write_pkg(base: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = base / PKG / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return base


@contextmanager
def _imported(base: Path, also: tuple[str, ...] = UNREACHED) -> Iterator[Any]:
    """Import the tiny package from ``base`` and forget it afterwards, so the next copy loads."""
    sys.path.insert(0, str(base))
    importlib.invalidate_caches()
    try:
        kernel = importlib.import_module(f"{PKG}.kernel")
        for name in also:
            importlib.import_module(name)
        assert Path(kernel.__file__).resolve().is_relative_to(base.resolve())
        yield kernel
    finally:
        sys.path.remove(str(base))
        for name in [n for n in sys.modules if n == PKG or n.startswith(PKG + ".")]:
            del sys.modules[name]


def _fingerprint(base: Path, also: tuple[str, ...] = UNREACHED) -> str:
    with _imported(base, also) as kernel:
        return source_fingerprint(kernel, PKG)


@pytest.fixture
def no_bytecode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies differ by one byte at equal size and mtime: a .pyc could mask the change."""
    monkeypatch.setattr(sys, "dont_write_bytecode", True)


def test_fingerprint_is_content_based_not_path_based(tmp_path: Path, no_bytecode: None) -> None:
    a = _fingerprint(_write_pkg(tmp_path / "install-a" / "site-packages", TINY_PKG))
    b = _fingerprint(_write_pkg(tmp_path / "elsewhere" / "b", TINY_PKG))
    assert a == b


def test_fingerprint_of_a_copied_tree_matches(tmp_path: Path, no_bytecode: None) -> None:
    """The use case: a cache root and its package copied to another prefix still hit."""
    src = _write_pkg(tmp_path / "a", TINY_PKG)
    first = _fingerprint(src)
    shutil.copytree(src, tmp_path / "copy")
    assert _fingerprint(tmp_path / "copy") == first


@pytest.mark.parametrize("changed_file", ["kernel.py", "helpers.py", "deep.py", "consts.py", "__init__.py", "sub/__init__.py"])
def test_fingerprint_covers_every_reached_module(tmp_path: Path, no_bytecode: None, changed_file: str) -> None:
    base = _fingerprint(_write_pkg(tmp_path / "a", TINY_PKG))
    files = dict(TINY_PKG, **{changed_file: TINY_PKG[changed_file] + "# edited\n"})
    assert _fingerprint(_write_pkg(tmp_path / "b", files)) != base


def test_fingerprint_sees_one_byte_at_equal_size(tmp_path: Path, no_bytecode: None) -> None:
    base = _fingerprint(_write_pkg(tmp_path / "a", TINY_PKG))
    files = dict(TINY_PKG, **{"deep.py": TINY_PKG["deep.py"].replace('"a"', '"b"')})
    assert len(files["deep.py"]) == len(TINY_PKG["deep.py"]) and files != TINY_PKG
    assert _fingerprint(_write_pkg(tmp_path / "b", files)) != base


@pytest.mark.parametrize("changed_file", ["unrelated.py", "sub/noise.py"])
def test_fingerprint_ignores_modules_nothing_reaches(tmp_path: Path, no_bytecode: None, changed_file: str) -> None:
    base = _fingerprint(_write_pkg(tmp_path / "a", TINY_PKG))
    files = dict(TINY_PKG, **{changed_file: TINY_PKG[changed_file] + "# edited\n"})
    assert _fingerprint(_write_pkg(tmp_path / "b", files)) == base


def test_fingerprint_does_not_depend_on_what_else_is_imported(tmp_path: Path, no_bytecode: None) -> None:
    """An engine that imported more of the package first must still hit a prewarmed cache."""
    src = _write_pkg(tmp_path / "a", TINY_PKG)
    assert _fingerprint(src, also=()) == _fingerprint(src, also=UNREACHED)


def test_fingerprint_includes_module_names(tmp_path: Path, no_bytecode: None) -> None:
    """Moving code between modules changes what imports what: not the same source tree."""
    base = _fingerprint(_write_pkg(tmp_path / "a", TINY_PKG))
    files = {k: v.replace(f"{PKG}.deep", f"{PKG}.deeper") for k, v in TINY_PKG.items() if k != "deep.py"}
    files["deeper.py"] = TINY_PKG["deep.py"]
    assert _fingerprint(_write_pkg(tmp_path / "b", files)) != base


# --------------------------------------------------------------------------------------------
# Code without a .py file: hashed by what runs, or refused (issue 15, item 3)
# --------------------------------------------------------------------------------------------


def _pyc_only(base: Path, body: str) -> Path:
    """A package whose kernel module ships as a .pyc alone (what compiled or stripped installs do)."""
    import py_compile

    src = _write_pkg(base, {**TINY_PKG, "kernel.py": TINY_PKG["kernel.py"] + body})
    py_compile.compile(str(src / PKG / "kernel.py"), cfile=str(src / PKG / "kernel.pyc"), doraise=True)
    (src / PKG / "kernel.py").unlink()
    return src


def test_pyc_only_module_is_fingerprinted_by_its_bytecode(tmp_path: Path, no_bytecode: None) -> None:
    """Old code hashed nothing for a module without a .py file: two different kernels, one key."""
    a = _fingerprint(_pyc_only(tmp_path / "a", "X = 1\n"))
    b = _fingerprint(_pyc_only(tmp_path / "b", "X = 2\n"))
    assert a != b


def test_zip_imported_module_is_fingerprinted_from_its_source(tmp_path: Path, no_bytecode: None) -> None:
    import zipfile

    def zipped(name: str, body: str) -> Path:
        src = _write_pkg(tmp_path / name, {**TINY_PKG, "kernel.py": TINY_PKG["kernel.py"] + body})
        archive = tmp_path / f"{name}.zip"
        with zipfile.ZipFile(archive, "w") as z:
            for path in sorted((src / PKG).rglob("*.py")):
                z.write(path, path.relative_to(src).as_posix())
        return archive

    prints = []
    for name, body in (("a", "X = 1\n"), ("b", "X = 2\n")):
        archive = zipped(name, body)
        sys.path.insert(0, str(archive))
        importlib.invalidate_caches()
        try:
            kernel = importlib.import_module(f"{PKG}.kernel")
            assert ".zip" in kernel.__file__
            prints.append(source_fingerprint(kernel, PKG))  # old code: NotADirectoryError
        finally:
            sys.path.remove(str(archive))
            for mod in [n for n in sys.modules if n == PKG or n.startswith(PKG + ".")]:
                del sys.modules[mod]
    assert prints[0] != prints[1]


def test_module_with_no_code_to_read_is_unkeyable() -> None:
    """A module made in memory (a notebook cell's __main__, exec'd code): refuse, never key on nothing."""
    import types

    mod = types.ModuleType("cdc_in_memory_kernels")
    exec("def kernel():\n    return 1\n", mod.__dict__)
    with pytest.raises(UnkeyableError, match="no source or module file"):
        source_fingerprint(mod, "cdc_in_memory_kernels")


def test_environment_reads_are_found_in_source() -> None:
    source = b"""
import os
A = os.environ.get("FLASHINFER_B12X_MICRO_SHARE_INPUT", "0")
B = os.getenv('MOE_AUTOTUNE')
C = os.environ["FLASHINFER_B12X_STATIC_COMPACT_CUTOVER_PAIRS"]
D = _env_int("FLASHINFER_B12X_FORCE_MOE_W4A16", 0)
if "SOME_SWITCH" in os.environ: pass
print("NOT_AN_ENV_READ")
"""
    assert keymod.env_reads(source) == (
        "FLASHINFER_B12X_FORCE_MOE_W4A16", "FLASHINFER_B12X_MICRO_SHARE_INPUT", "FLASHINFER_B12X_STATIC_COMPACT_CUTOVER_PAIRS",
        "MOE_AUTOTUNE", "SOME_SWITCH")
    env = {"MOE_AUTOTUNE": "1", "LOCAL_RANK": "3", "FLASHINFER_LOGLEVEL": "2", "CUTE_DSL_OPT": "x", "UNSET_ONE": "1"}
    from cute_diskcache.flashinfer_sites._common import NOT_CODEGEN_ENV

    reads = ("MOE_AUTOTUNE", "LOCAL_RANK", "FLASHINFER_LOGLEVEL", "CUTE_DSL_OPT", "NOT_SET")
    assert keymod.keyed_env(reads, env, not_codegen=NOT_CODEGEN_ENV) == {"MOE_AUTOTUNE": "1"}


def test_what_a_gpu_container_runtime_sets_is_no_key() -> None:
    """The NVIDIA container runtime sets NVIDIA_VISIBLE_DEVICES (and the driver capabilities) in
    every GPU pod; b12x's code reads it (a PCIe probe's report), so keying it made every b12x entry
    prewarmed on a CPU box miss on the lent H100 (bench/results/gpu_proof_b12x_h100_before.json)."""
    env = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility", "CUFILE_ENV_PATH_JSON": "/etc/cufile.json",
           "B12X_FAST_MATH": "1"}
    assert keymod.keyed_env(tuple(env), env) == {"B12X_FAST_MATH": "1"}
