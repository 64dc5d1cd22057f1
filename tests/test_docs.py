"""The documentation: every relative link in the README and docs/ resolves (file and anchor), the README stays a
front door, and docs/manifest.md is what runner.manifest.docgen makes of the current schema."""

import re
import subprocess
import sys
from itertools import zip_longest
from pathlib import Path

import pytest

from runner.manifest import docgen
from runner.manifest.schema import Manifest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "plans" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
README_MOST_LINES = 200


def _links() -> list[tuple[str, str]]:
    """(page, target) for every relative link: external addresses and same-page anchors are left out."""
    return [(str(page.relative_to(ROOT)), target) for page in PAGES for target in LINK.findall(page.read_text("utf-8"))
            if "://" not in target and not target.startswith(("#", "mailto:"))]


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors (lower case, punctuation dropped, spaces → hyphens) and explicit <a id>s."""
    text = page.read_text("utf-8")
    headings = re.findall(r"^#{1,6} (.+)$", text, flags=re.MULTILINE)
    slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
    return slugs | set(re.findall(r'<a id="([^"]+)"></a>', text))


def test_readme_links_to_docs():
    """The README is the front door: it links the manifest reference and every page beside it."""
    linked = {target.split("#")[0] for page, target in _links() if page == "README.md"}
    assert "docs/manifest.md" in linked
    assert len([t for t in linked if t.startswith("docs/")]) >= 8


@pytest.mark.parametrize("page, target", _links())
def test_link_resolves(page, target):
    """Every relative link names a file that exists (docs/troubleshooting.md, docs/clusters.md and
    docs/architecture.md are written on other branches and must exist once they are merged) and, with
    #anchor, a heading or <a id> in it."""
    path, _, anchor = target.partition("#")
    resolved = (ROOT / page).parent / path
    assert resolved.exists(), f"{page}: link to {target} but {resolved.relative_to(ROOT)} does not exist"
    if anchor and resolved.suffix == ".md":
        assert anchor in _anchors(resolved), f"{page}: link to {target} but {path} has no anchor #{anchor}"


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text("utf-8").count("\n")
    assert lines <= README_MOST_LINES, (f"README.md has {lines} lines (at most {README_MOST_LINES}): move reference "
                                        f"material to a page under docs/ and link it")


def test_manifest_reference_is_current():
    current, rendered = (ROOT / "docs" / "manifest.md").read_text("utf-8"), docgen.render()
    if current != rendered:
        pairs = zip_longest(current.splitlines(), rendered.splitlines())
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), 0)
        pytest.fail(f"docs/manifest.md is out of date with runner/manifest/schema.py "
                    f"(first difference at line {first + 1}): "
                    f"regenerate it with `{docgen.COMMAND}`")


def test_manifest_reference_has_every_key():
    """Every model reachable from Manifest has its section and every one of its keys a row."""
    text = docgen.render()
    for model in docgen._blocks(Manifest):
        section = text.split(f'<a id="{docgen._anchor(model)}"></a>')[1].split("<a id=")[0]
        for name in model.model_fields:
            assert f"| `{name}` |" in section, f"{model.__name__}.{name} missing from docs/manifest.md"


def test_docgen_imports_no_torch():
    """The reference is generated from the schema alone: no torch or transformers import, so it is cheap."""
    code = ("import sys; from runner.manifest import docgen; docgen.render(); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
