"""Writes docs/verl_migration.md from the verl key table (rlhf_ops.config.verl_keys); --check: exit 1 if stale."""

from __future__ import annotations

import sys
from pathlib import Path

from rlhf_ops.verl_migration_doc import migration_markdown

PAGE = Path(__file__).resolve().parents[1] / "docs" / "verl_migration.md"


def main(argv: list[str]) -> int:
    text = migration_markdown()
    if "--check" in argv:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE} is stale: run python scripts/gen_verl_docs.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
