"""Every relative link of README.md and docs/*.md resolves: the file it names exists, and its
``#anchor`` names a heading of that file (GitHub's heading ids). A section cut by an edit
leaves the links to it dangling; this is where that shows."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def heading_id(title: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped (hyphens and underscores
    kept), each space a hyphen."""
    title = re.sub(r"[`*]", "", title.strip().lower())
    return re.sub(r"[^\w\- ]", "", title).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {heading_id(m) for m in re.findall(r"^#{1,6} +(.+?) *#*$", text, flags=re.M)}


def relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_heading_ids_follow_github():
    assert heading_id("SigLIP, NT-Xent, duplicates, gradient filtering") == \
        "siglip-nt-xent-duplicates-gradient-filtering"
    assert heading_id("Real-photo shards (the input of the end-to-end rows)") == \
        "real-photo-shards-the-input-of-the-end-to-end-rows"
    assert heading_id("Memory against global batch, to 1M") == "memory-against-global-batch-to-1m"
    assert heading_id("`model.compile` and DDP") == "modelcompile-and-ddp"


def test_the_pages_link_somewhere():
    assert sum(len(relative_links(p)) for p in PAGES) >= 20


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading '#{anchor}' in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
