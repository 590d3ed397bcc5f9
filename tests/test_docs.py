"""The README and docs/ stay navigable and true: every relative link resolves, every setting is
documented with the default the code uses, and every command, option and variable they name exists.

A page moved or renamed without its links, a setting added to ``config.SETTINGS`` without a row
in docs/settings.md (or a default changed on one side only), or a command renamed under its
docs fails here instead of on a user's screen.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in _FENCE.sub("", page.read_text()).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return out


def _links(page: Path) -> list[str]:
    return [m.group(1) for m in _LINK.finditer(_FENCE.sub("", page.read_text()))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for link in _links(page):
        if re.match(r"[a-z]+:", link):  # http:, https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link} (no {target.relative_to(REPO) if target.is_relative_to(REPO) else target})")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link} (no heading #{anchor} in {target.name})")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_the_readme_fits_on_a_few_screens() -> None:
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


def _settings_rows() -> dict[str, str]:
    """docs/settings.md's table: variable -> its default cell, as a reader sees it (no links, no code marks)."""
    rows = re.finditer(r"^\| `([A-Z0-9_]+)` \| ([^|]*) \|", (REPO / "docs" / "settings.md").read_text(), re.M)
    return {m.group(1): re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(2)).replace("`", "").strip() for m in rows}


def test_every_setting_is_documented_with_its_default() -> None:
    """config.SETTINGS holds each default once; docs/settings.md says what it means, and the same default."""
    from cute_diskcache import config

    rows = _settings_rows()
    missing = [env for env, _d in config.SETTINGS.values() if env not in rows]
    assert not missing, f"docs/settings.md lacks {missing}"
    differ = {env: (default, rows[env]) for env, default in config.SETTINGS.values() if rows[env] != default}
    assert not differ, f"defaults (config.SETTINGS, docs/settings.md) that differ: {differ}"


def test_the_defaults_the_code_uses_are_the_tables() -> None:
    """What load() gives with nothing set is what config.SETTINGS (and so the docs) says."""
    from cute_diskcache import config
    from cute_diskcache.storage import locking

    env = {name: value for name, value in os.environ.items() if not name.startswith("CUTE_DISKCACHE_")}
    with pytest.MonkeyPatch.context() as mp:
        for name in set(os.environ) - set(env):
            mp.delenv(name)
        s = config.load()
    for field in ("lock_timeout", "remote_timeout", "remote_cooldown"):
        assert getattr(s, field) == float(config.SETTINGS[field][1]), field
    for field in ("single_flight", "readonly", "trust_shared", "remote_readonly", "remote_unsigned"):
        assert getattr(s, field) == (config.SETTINGS[field][1] == "1"), field
    assert s.remote_prefix == config.SETTINGS["remote_prefix"][1] and s.native_sites == config.SETTINGS["native_sites"][1]
    assert s.max_size == config.parse_size(config.SETTINGS["max_size"][1])
    assert locking.DEFAULT_TIMEOUT_S == s.lock_timeout, "one lock-timeout default, wherever it is read"


def _code_mentions(pattern: str) -> list[tuple[str, str]]:
    """``(page, match)`` for each match of ``pattern`` in the pages' code: inline spans and fenced blocks."""
    out = []
    for page in PAGES:
        text = page.read_text()
        code = [m.group(1) for m in re.finditer(r"`([^`\n]+)`", _FENCE.sub("", text))] + _FENCE.findall(text)
        out += [(page.name, m.group(0)) for chunk in code for m in re.finditer(pattern, chunk)]
    return out


def test_every_variable_the_docs_name_exists() -> None:
    """A CUTE_DISKCACHE_* variable in the docs is a setting, or one the test suite or a script reads."""
    from cute_diskcache import config

    known = {env for env, _d in config.SETTINGS.values()}
    harness = "".join(p.read_text() for top in ("tests", "scripts", "bench") for p in sorted((REPO / top).glob("*.py")))
    named = {m for page in PAGES for m in re.findall(r"CUTE_DISKCACHE_[A-Z0-9_]*[A-Z0-9]", page.read_text())}
    unknown = sorted(v for v in named - known if v not in harness)
    assert not unknown, f"the docs name variables nothing reads: {unknown}"


def test_every_command_and_option_the_docs_show_exists() -> None:
    """``cute-diskcache COMMAND --option`` (or ``python -m cute_diskcache ...``) in the docs' code is a
    command the CLI has, with that option.

    A word after ``cute-diskcache`` that is no command must begin one of the log lines the package
    prints (``cute-diskcache refuses ...``), which the docs quote."""
    import argparse

    from cute_diskcache import cli

    ap = cli.build_parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    options = {name: {o for a in p._actions for o in a.option_strings} for name, p in sub.choices.items()}
    globals_ = {o for a in ap._actions for o in a.option_strings}
    package = "".join(p.read_text() for p in sorted((REPO / "cute_diskcache").rglob("*.py")))
    wrong = []
    for page, text in _code_mentions(r"(?<![\w/.-])(?:cute-diskcache|python -m cute_diskcache) [a-z][a-z-]*[^|;&#\n`]*"):
        word, rest = re.match(r"(?:cute-diskcache|python -m cute_diskcache) ([a-z][a-z-]*)(.*)", text, re.S).groups()
        if word not in options:
            if f"cute-diskcache {word} " not in package:
                wrong.append(f"{page}: {text.strip()} (no command {word!r})")
            continue
        for flag in re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", rest):
            if flag not in options[word] | globals_:
                wrong.append(f"{page}: {text.strip()} (no option {flag} of {word})")
    assert not wrong, "\n".join(wrong)


def test_readme_settings_are_real_settings() -> None:
    """The README's short table names only variables the code reads (none renamed away)."""
    from cute_diskcache import config

    known = {env for env, _d in config.SETTINGS.values()}
    readme = (REPO / "README.md").read_text()
    table = readme.split("## Settings", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `([A-Z0-9_]+)` \|", table, re.M))
    assert named and named <= known, f"README names unknown settings: {sorted(named - known)}"
