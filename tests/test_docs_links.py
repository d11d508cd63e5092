"""The README and the docs pages hold together: every relative link points to a file that exists, every
`#anchor` to a heading of that file (GitHub's slugs), the README links every docs page, and every file the
README names in backticks exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, inline code marks and punctuation dropped (letters,
    digits, `_`, `-` and spaces kept), spaces as hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    return [target for target in LINK.findall(prose(path.read_text()))
            if not re.match(r"[a-z]+:", target)]  # http:, https:, mailto: are not checked


def test_the_slug_rule():
    assert slug("Large payloads outside Redis (`GRADSVC_HANDOFF_DIR`)") == \
        "large-payloads-outside-redis-gradsvc_handoff_dir"
    assert slug("Result (200 from POST /gradients; `result` of GET /jobs/{id})") == \
        "result-200-from-post-gradients-result-of-get-jobsid"
    assert slug("The SDK's transport") == "the-sdks-transport"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    problems = []
    for target in links(page):
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            problems.append(f"{target}: no file {dest.relative_to(ROOT) if ROOT in dest.parents else dest}")
            continue
        if anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            problems.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not problems, problems


def test_the_readme_links_every_docs_page():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in links(README)}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not missing, missing


def test_every_file_the_readme_names_exists():
    names = re.findall(r"`([\w./-]+\.(?:md|py|yml|yaml|json|toml|png))`", README.read_text())
    assert names
    missing = [n for n in names if not (ROOT / n).exists()]
    assert not missing, missing


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_page_names_exists(page):
    """A backticked file with a folder in its name (`gradsvc/engine/numcheck.py`) is a file of the repository."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    names = re.findall(r"`((?:[\w-]+/)+[\w.-]+\.(?:md|py|yml|yaml|json|toml|png))`", text)
    missing = [n for n in names if not (ROOT / n).exists()]
    assert not missing, missing


PACKAGE_DIRS = ("gradsvc", "service", "workers", "gradclient")


def _layout_sections() -> dict[str, str]:
    """docs/architecture.md's Layout drawing, by the folder each paragraph starts with ("gradsvc/engine/": text)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text[text.index("## Layout"):]
    block = block[block.index("```") + 3:]
    sections: dict[str, str] = {}
    current = None
    for line in block[:block.index("```")].splitlines():
        head = re.match(r"^([\w.]+(?:/[\w.]+)*/)\s", line)
        if head:
            current = head.group(1)
        if current:
            sections[current] = sections.get(current, "") + line + "\n"
    return {folder: body for folder, body in sections.items() if folder.split("/")[0] in PACKAGE_DIRS}


def test_the_layout_drawing_names_every_module_where_it_lives_and_none_that_is_gone():
    """Each module of the four packages is named in the paragraph of the deepest folder drawn above it (or by its
    path), and every bare `name.py` a paragraph names is a module under that folder."""
    sections = _layout_sections()
    found: dict[str, set[str]] = {}
    unnamed = []
    for path in sorted(p for d in PACKAGE_DIRS for p in (ROOT / d).rglob("*.py") if p.name != "__init__.py"):
        rel = path.relative_to(ROOT).as_posix()
        folder = max((f for f in sections if rel.startswith(f)), key=len)
        found.setdefault(folder, set()).add(path.name)
        bare = re.search(r"(?<![\w/.])" + re.escape(path.name) + r"(?!\w)", sections[folder])
        if not bare and rel not in "".join(sections.values()):
            unnamed.append(rel)
    gone = sorted((folder, name) for folder, body in sections.items()
                  for name in set(re.findall(r"(?<![\w/.])(\w+\.py)\b", body)) - found.get(folder, set()) - {"__init__.py"})
    assert unnamed == [], "modules docs/architecture.md's Layout does not name: add a line for each"
    assert gone == [], "modules the Layout names that are not there (moved or renamed?)"
