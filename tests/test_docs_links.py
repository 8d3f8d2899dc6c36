"""The README leads each reader to their goal by links alone: every relative link in the README and under docs/
points at a file that exists, and the README links each of the three paths' first documents."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s#]+)(#[^)]*)?\)")


def _links(path: Path) -> list[str]:
    return [m[1] for m in LINK.finditer(path.read_text()) if "://" not in m[1]]


def test_every_relative_link_in_the_readme_and_the_docs_points_at_a_file():
    broken = [f"{page.relative_to(REPO)} -> {target}"
              for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
              for target in _links(page) if not (page.parent / target).exists()]
    assert broken == []


def test_the_readme_has_a_path_for_the_researcher_the_admin_and_the_bed_and_the_index_lists_every_document():
    readme = set(_links(REPO / "README.md"))
    assert {"docs/user-guide.md", "docs/troubleshooting.md", "docs/admin.md", "docs/configuration.md",
            "docs/testbed.md", "docs/index.md"} <= readme
    listed = {Path(t).name for t in _links(REPO / "docs" / "index.md")}
    assert {p.name for p in (REPO / "docs").glob("*.md")} - {"index.md"} <= listed
