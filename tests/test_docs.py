"""The README and docs/ stay navigable: every relative link resolves, every setting is documented.

A page moved or renamed without its links, or a setting added to ``config.SETTINGS_DOC``
without a line in docs/settings.md, fails here instead of on a user's screen.
"""

from __future__ import annotations

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


def test_every_setting_is_documented() -> None:
    from cute_diskcache import config

    settings = (REPO / "docs" / "settings.md").read_text()
    missing = [env for env, _d, _m in config.SETTINGS_DOC.values() if f"| `{env}` |" not in settings]
    assert not missing, f"docs/settings.md lacks {missing}"


def test_readme_settings_are_real_settings() -> None:
    """The README's short table names only variables the code reads (none renamed away)."""
    from cute_diskcache import config

    known = {env for env, _d, _m in config.SETTINGS_DOC.values()}
    readme = (REPO / "README.md").read_text()
    table = readme.split("## Settings", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `([A-Z0-9_]+)` \|", table, re.M))
    assert named and named <= known, f"README names unknown settings: {sorted(named - known)}"
