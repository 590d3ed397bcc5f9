"""ruff, with the settings in pyproject.toml, finds nothing in the package or scripts/.

The rules (pyflakes, bugbear, pyupgrade, and BLE001: a broad ``except`` narrowed or given its
reason) catch what a reader would otherwise stop at: an unused name, a ``zip`` that silently
drops a tail, an ``except Exception`` that does not say which failure it stands for. A ``# noqa``
must say why in words, or the next reader learns nothing from it. tests/ and bench/ are not
linted yet (fixtures imported into test modules by name, and the benches' many broad excepts).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINTED = ("cute_diskcache", "scripts")
# "# noqa: CODE[, CODE...]" and then words of its own: "- why", "(why)" or plain words.
_NOQA = re.compile(r"#\s*noqa\b(?::\s*[A-Z]+[0-9]+(?:\s*,\s*[A-Z]+[0-9]+)*)?(?P<rest>.*)$")


def _ruff(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *args],
                          cwd=REPO, input=stdin, capture_output=True, text=True, timeout=120)


def test_ruff_finds_nothing() -> None:
    r = _ruff(*LINTED)
    assert r.returncode == 0, f"ruff findings (fix them, or narrow the except; a noqa says why):\n{r.stdout}{r.stderr}"


@pytest.mark.parametrize(("snippet", "rule"), [
    ("def f():\n    try:\n        pass\n    except Exception:\n        pass\n", "BLE001"),
    ("import os\n", "F401"),
    ("def f(xs, ys):\n    return list(zip(xs, ys))\n", "B905"),
    ("from typing import Callable\n\nF: Callable[[], None]\n", "UP035"),
    ("import os  # noqa: F401\n\nos.getpid()\n", "RUF100"),
])
def test_the_configured_rules_are_on(snippet: str, rule: str) -> None:
    """The settings the clean run above relies on: each rule the issue asked for does report."""
    r = _ruff("--stdin-filename", "cute_diskcache/_lint_probe.py", "-", stdin=snippet)
    assert rule in r.stdout, r.stdout + r.stderr


def test_every_noqa_gives_a_reason() -> None:
    bare = []
    for top in LINTED:
        for path in sorted((REPO / top).rglob("*.py")):
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                m = _NOQA.search(line)
                if m and not re.search(r"[A-Za-z]{3,}", m.group("rest")):
                    bare.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not bare, "a noqa must say why in words:\n" + "\n".join(bare)
