"""The package's layout holds: one home per mechanism, data flowing one way.

Read from the source (no imports of flashinfer or the DSL): every setting is read through
``config`` and listed in its table, no two modules import each other, each folder imports only
the layers below it, and flashinfer's module names appear only in the adapter.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from cute_diskcache import config

PKG = Path(__file__).resolve().parent.parent / "cute_diskcache"
#: Reads allowed outside config.py, each with its reason.
START_UP_READS = {
    # The .pth hook runs install() at interpreter start: config's imports (dataclasses...) would cost every process.
    ("activation.py", "CUTE_DISKCACHE_TARGET"),
}
_ENV_CALLS = {("environ", "get"), ("os", "getenv"), ("", "env_flag"), ("config", "env_flag"), ("", "_float_env")}


def _sources() -> dict[str, ast.Module]:
    return {str(p.relative_to(PKG)): ast.parse(p.read_text(), str(p)) for p in sorted(PKG.rglob("*.py"))}


def _module_name(rel: str) -> str:
    parts = list(Path(rel).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["cute_diskcache", *parts])


def _env_reads(tree: ast.Module) -> list[str]:
    """Names of our variables this module reads: os.environ.get / [] / in, os.getenv, env_flag."""
    ours = (config.ENABLE_ENV, "CUTE_DISKCACHE_")
    found: list[str] = []

    def literal(node: ast.AST) -> str | None:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(ours) else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            owner = f.value.attr if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Attribute) else (
                f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else "")
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if (owner, name) in _ENV_CALLS and literal(node.args[0]):
                found.append(literal(node.args[0]))  # type: ignore[arg-type]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "environ" and literal(node.slice):
            found.append(literal(node.slice))  # type: ignore[arg-type]
        elif isinstance(node, ast.Compare) and literal(node.left) and any(
                isinstance(c, ast.Attribute) and c.attr == "environ" for c in node.comparators):
            found.append(literal(node.left))  # type: ignore[arg-type]
    return found


def test_every_setting_is_read_through_the_settings_table() -> None:
    """A variable read elsewhere escapes the table the README is made from (CUTE_DISKCACHE_MAX_SIZE once did)."""
    stray = [(rel, name) for rel, tree in _sources().items() if rel != "config.py"
             for name in _env_reads(tree) if (rel, name) not in START_UP_READS]
    assert not stray, f"read these through config (config.flag / config.text / config.load): {stray}"


def test_every_variable_the_package_names_is_in_the_settings_table() -> None:
    documented = {env for env, _default in config.SETTINGS.values()}
    named = {m for p in PKG.rglob("*.py") for m in re.findall(r"CUTE_DISKCACHE_[A-Z0-9_]+", p.read_text())}
    assert named - documented == set(), "every CUTE_DISKCACHE_* variable is a setting with a row in config.SETTINGS"
    assert config.ENABLE_ENV == config.SETTINGS["enabled"][0]


def test_the_reads_this_test_knows_are_found() -> None:
    """The scan above can fail: it finds each way of reading a variable."""
    tree = ast.parse(
        'import os\nos.environ.get("CUTE_DISKCACHE_A")\nos.environ["CUTE_DISKCACHE_B"]\nos.getenv("CUTE_DISKCACHE_C")\n'
        'env_flag("CUTE_DISKCACHE_D")\nif "CUTE_DISKCACHE_E" in os.environ: pass\nos.environ["CUTE_DISKCACHE_F"] = "1"\n'
    )
    assert sorted(_env_reads(tree)) == ["CUTE_DISKCACHE_A", "CUTE_DISKCACHE_B", "CUTE_DISKCACHE_C", "CUTE_DISKCACHE_D", "CUTE_DISKCACHE_E"]


def _imports() -> dict[str, set[str]]:
    """module -> the package's modules it imports, at any depth (lazy imports count too)."""
    root = PKG.parent
    graph: dict[str, set[str]] = {}
    for rel, tree in _sources().items():
        me = _module_name(rel)
        package = me if rel.endswith("__init__.py") else me.rsplit(".", 1)[0]
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
                target = ".".join(base + ([node.module] if node.module else [])) if node.level else (node.module or "")
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    is_module = (root / (sub.replace(".", "/") + ".py")).exists() or (root / sub.replace(".", "/") / "__init__.py").exists()
                    deps.add(sub if is_module else target)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[me] = {d for d in deps if d.startswith("cute_diskcache") and d != me}
    return graph


def test_no_two_modules_import_each_other() -> None:
    """Data flows one way (targets and devicefacts once imported each other). A package and
    its own submodules may (the package's ``__init__`` holds what they share)."""
    graph = _imports()
    both = sorted({tuple(sorted((a, b))) for a, deps in graph.items() for b in deps if a in graph.get(b, set())})
    both = [(a, b) for a, b in both if not b.startswith(a + ".")]
    assert not both, both


def test_flashinfer_module_names_live_in_the_adapter() -> None:
    """Only flashinfer_sites/ names flashinfer's modules (the import hook reads flashinfer_sites.names)."""
    outside = []
    for rel, tree in _sources().items():
        if rel.startswith("flashinfer_sites/"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"flashinfer(\.\w+)+", node.value):
                outside.append((rel, node.value))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flashinfer.") and node.level == 0:
                outside.append((rel, node.module))
    assert not outside, outside


#: Each folder may import the foundations at the root and the folders listed (issue 32 item 5:
#: the folders are the layers). Adapters and the operator's side stand above the rest.
FOUNDATIONS = {"config", "errors", "logsetup", "_version"}
LAYERS = {
    "keys": set(),
    "storage": {"keys"},
    "remote": {"keys", "storage"},
    "core": {"keys", "storage", "remote"},
}


def test_each_layer_imports_only_the_layers_below() -> None:
    """keys/ stands on the foundations, storage/ on keys/, remote/ on storage/, core/ on all three;
    neither they nor the adapters import cli/ or prewarm/ (the operator's side, on top, with the
    doors at the root)."""
    wrong = []
    for me, deps in _imports().items():
        mine = me.split(".")[1] if "." in me else ""
        for dep in deps:
            theirs = dep.split(".")[1] if "." in dep else ""
            if theirs in ("cli", "prewarm") and (mine in LAYERS or mine.endswith("_sites")):  # every library's adapter
                wrong.append((me, dep))
            elif mine in LAYERS and theirs != mine and theirs not in FOUNDATIONS | LAYERS[mine]:
                wrong.append((me, dep))
    assert not wrong, wrong


#: Imports that reach a device or the DSL: device access lives in keys/ (``gpu``, ``devicefacts``)
#: and core/, never on the operator's side, which only asks those layers.
_DEVICE_MODULES = ("cuda", "cutlass")
#: Key policy the operator's side once held: each name must be defined in keys/ and nowhere else.
KEY_POLICY = {"arch_runs_on"}


def test_the_operator_side_holds_no_key_policy_and_no_driver_access() -> None:
    """cli/ is the operator's side with no policy of its own: the rule for which arch runs on which
    capability (``verify --device``'s) is key policy, and the CUDA driver wrapper is device access;
    both once lived in cli/gpu.py."""
    wrong = []
    defined_in: dict[str, list[str]] = {}
    for rel, tree in _sources().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in KEY_POLICY:
                defined_in.setdefault(node.name, []).append(rel)
            if not rel.startswith("cli/"):
                continue
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            wrong += [(rel, n) for n in names if n.split(".")[0] in _DEVICE_MODULES]
    assert not wrong, f"cli/ imports the driver or the DSL itself: {wrong}"
    for name in KEY_POLICY:
        assert [rel.split("/")[0] for rel in defined_in.get(name, [])] == ["keys"], (name, defined_in.get(name))


SCRIPTS = PKG.parent / "scripts"


def test_no_two_scripts_import_each_other() -> None:
    """What two scripts share lives in one module both import (compat_matrix.py and compat_b12x.py
    once imported each other, one of them lazily inside a function)."""
    mine = {p.stem for p in SCRIPTS.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for p in SCRIPTS.glob("*.py"):
        deps: set[str] = set()
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Import):
                deps.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                deps.add(node.module.split(".")[0])
        graph[p.stem] = (deps & mine) - {p.stem}
    both = sorted({tuple(sorted((a, b))) for a, deps in graph.items() for b in deps if a in graph.get(b, set())})
    assert not both, both
