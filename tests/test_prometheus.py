"""``stats --format prometheus``: node_exporter's textfile format, read back by prometheus_client's own parser."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _helpers, whatever pytest's import mode

from _helpers import make_artifact, make_key  # noqa: E402

from cute_diskcache import cli  # noqa: E402
from cute_diskcache.storage import stats  # noqa: E402
from cute_diskcache.storage.store import Store  # noqa: E402

pytestmark = pytest.mark.usefixtures("isolated_stats")

parser = pytest.importorskip("prometheus_client.parser")

#: A statistics namespace is any string a process counted under: the exposition must escape it.
ODD = 'ns "quoted" back\\slash\nnewline'


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A root with one real entry and counts in two namespaces (one of them oddly named)."""
    root = tmp_path / "root"
    key = make_key("micro")
    assert Store(root).commit(key, make_artifact()) is not None
    stats.bind(root)
    ns = key.env.namespace
    for _ in range(3):
        stats.record(ns, "hits")
    stats.record(ns, "misses")
    stats.record(ns, "compiles")
    stats.record(ns, "compile_seconds", 2.5)
    stats.record(ns, "saved_seconds", 7.25)
    stats.record(ODD, "hits", 4)
    stats.flush()
    return root


def render(root: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = cli.main(["--root", str(root), "stats", "--format", "prometheus", *args])
    return code, capsys.readouterr().out


def test_prometheus_client_reads_every_family(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, text = render(root, capsys)
    assert code == 0
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    ns = make_key("micro").env.namespace

    def value(family: str, sample: str, namespace: str | None) -> float:
        (v,) = [s.value for s in families[family].samples
                if s.name == sample and s.labels.get("namespace") == namespace and s.labels["root"] == str(root)]
        return v

    # counters: the family is named without _total, the sample with it (the client's reading)
    assert families["cute_diskcache_hits"].type == "counter"
    assert value("cute_diskcache_hits", "cute_diskcache_hits_total", ns) == 3
    assert value("cute_diskcache_hits", "cute_diskcache_hits_total", ODD) == 4, "the label value comes back unescaped"
    assert value("cute_diskcache_misses", "cute_diskcache_misses_total", ns) == 1
    assert value("cute_diskcache_compiles", "cute_diskcache_compiles_total", ns) == 1
    assert value("cute_diskcache_compile_seconds", "cute_diskcache_compile_seconds_total", ns) == 2.5
    assert value("cute_diskcache_saved_seconds", "cute_diskcache_saved_seconds_total", ns) == 7.25
    assert families["cute_diskcache_entries"].type == families["cute_diskcache_bytes"].type == "gauge"
    assert value("cute_diskcache_entries", "cute_diskcache_entries", ns) == 1
    assert value("cute_diskcache_bytes", "cute_diskcache_bytes", ns) > 0
    assert value("cute_diskcache_entries", "cute_diskcache_entries", ODD) == 0
    assert value("cute_diskcache_root_trusted", "cute_diskcache_root_trusted", None) == 1
    assert value("cute_diskcache_cache_bytes", "cute_diskcache_cache_bytes", None) >= value("cute_diskcache_bytes", "cute_diskcache_bytes", ns)
    assert all(f.documentation for f in families.values()), "every family has its # HELP"


_HELP = re.compile(r"^# HELP (cute_diskcache_[a-z_]+) \S.*$")
_TYPE = re.compile(r"^# TYPE (cute_diskcache_[a-z_]+) (counter|gauge)$")
_SAMPLE = re.compile(r'^(cute_diskcache_[a-z_]+)\{(?:[a-z]+="(?:[^"\\\n]|\\[\\"n])*"(?:,|(?=\})))+\} (-?[0-9.e+]+|NaN|[+-]Inf)$')


def test_every_line_is_strict_exposition_format(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Beyond what the client tolerates: HELP then TYPE once per family, before its samples;
    counters end in _total, byte and second metrics carry their unit."""
    _code, text = render(root, capsys)
    assert text.endswith("\n") and "\n\n" not in text
    typed: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# HELP"):
            assert _HELP.match(line), line
            current = _HELP.match(line).group(1)  # type: ignore[union-attr]
            assert current not in typed
        elif line.startswith("# TYPE"):
            m = _TYPE.match(line)
            assert m and m.group(1) == current, line
            typed[current] = m.group(2)
        else:
            m = _SAMPLE.match(line)
            assert m and m.group(1) == current, line
    assert all(name.endswith("_total") for name, kind in typed.items() if kind == "counter")
    assert {"cute_diskcache_hits_total", "cute_diskcache_misses_total", "cute_diskcache_compiles_total",
            "cute_diskcache_compile_seconds_total", "cute_diskcache_saved_seconds_total", "cute_diskcache_bytes",
            "cute_diskcache_entries"} <= set(typed)
    assert 'namespace="ns \\"quoted\\" back\\\\slash\\nnewline"' in text


def test_refused_root_reads_0_and_json_conflicts(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root.chmod(0o777)  # world-writable: serving processes refuse it
    try:
        _code, text = render(root, capsys)
    finally:
        root.chmod(0o700)
    assert f'cute_diskcache_root_trusted{{root="{root}"}} 0' in text.splitlines()
    code = cli.main(["--root", str(root), "stats", "--json", "--format", "prometheus"])
    said = capsys.readouterr()
    assert code == 2 and "two output formats" in said.out + said.err  # a JSON error object


def test_root_path_that_is_not_utf8_keeps_the_text_valid(tmp_path: Path) -> None:
    """Issue 29, finding 12: a root whose path holds a byte that is not UTF-8 went raw into the
    label, and the whole exposition (UTF-8 by definition) was invalid: every series lost."""
    import subprocess

    root = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/r\xffot"))
    assert Store(root).commit(make_key("micro"), make_artifact()) is not None
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_")}
    for locale in ("C.UTF-8", "C"):  # an engine's pod may have either
        proc = subprocess.run([sys.executable, "-m", "cute_diskcache", "--root", os.fsencode(str(root)), "stats", "--format", "prometheus"],
                              env={**env, "LC_ALL": locale, "PYTHONIOENCODING": ""}, capture_output=True, timeout=120)
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-2000:]
        text = proc.stdout.decode("utf-8")  # strict: the format is UTF-8
        families = {f.name: f for f in parser.text_string_to_metric_families(text)}
        (sample,) = families["cute_diskcache_entries"].samples
        assert sample.labels["root"].endswith("/r\\xffot") and sample.value == 1, sample
