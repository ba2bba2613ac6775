"""docs/architecture.md draws the package as it is: every stage and module in its tree, the
stage order the import test enforces."""

from __future__ import annotations

import re

from tests.test_architecture import LEAVES, PACKAGE, STAGES

DOC = (PACKAGE.parent / "docs" / "architecture.md").read_text()


def test_the_tree_names_every_module() -> None:
    tree = DOC[DOC.index("```\n"):DOC.index("```", DOC.index("```\n") + 4)]
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__init__.py" and path.parent != PACKAGE:
            continue
        stage = path.parent.name if path.parent != PACKAGE else None
        if stage is not None and f"  {stage}/" not in tree:
            missing.append(f"{stage}/")
        if not re.search(rf"\b{re.escape(path.stem)}\b", tree):
            missing.append(str(path.relative_to(PACKAGE)))
    assert not missing, missing


def test_the_stage_order_is_the_enforced_one() -> None:
    line = re.search(r"`(files < .*? < cli)`", DOC.replace("\n", " "))
    assert line is not None
    drawn = [s.strip() for s in line.group(1).split("<")]
    # engines/ may be drawn in the chain, or named apart while it has no package yet.
    assert drawn == [s for s in STAGES if s != "engines" or "engines" in drawn]
    assert "`engines/`" in DOC or "engines" in drawn
    assert all(f"`{leaf}`" in DOC for leaf in LEAVES)
