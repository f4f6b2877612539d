"""Writes docs/index.md, the site's front page, from README.md with its links made relative to docs/.

The README is the one source; ``--check`` exits 1 when docs/index.md is stale (tests/unit/docs/test_docs_site.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INDEX = ROOT / "docs" / "index.md"
# Root files that the site includes as pages of their own (docs/<page>.md holds a snippet of the file).
ROOT_PAGES = {
    "[SECURITY.md](SECURITY.md)": "[Security](security.md)",
    "[CONTRIBUTING.md](CONTRIBUTING.md)": "[Contributing](contributing.md)",
    "[CHANGELOG.md](CHANGELOG.md)": "[Changelog](changelog.md)",
    "[LICENSE](LICENSE)": "[License](license.md)",
}


def render(readme: str) -> str:
    """The front page: the README's text, links into ``docs/`` and to the root files rewritten for the site."""
    text = readme.replace("](docs/", "](")
    for old, new in ROOT_PAGES.items():
        text = text.replace(old, new)
    return "<!-- Generated from README.md by scripts/gen_docs_index.py. Do not edit by hand. -->\n" + text


def main(argv: list[str]) -> int:
    page = render((ROOT / "README.md").read_text())
    if "--check" in argv:
        if not INDEX.is_file() or INDEX.read_text() != page:
            print("docs/index.md is stale. Fix: .venv/bin/python scripts/gen_docs_index.py")
            return 1
        return 0
    INDEX.write_text(page)
    print("wrote docs/index.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
