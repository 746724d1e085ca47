"""mk/'s imports form no cycle (tools/import_graph.py), counting imports inside a function
or under TYPE_CHECKING as arrows, so none can dodge one; a planted cycle held open by a
late import is found, so the check is live.

Not here: the floors' order (STYLE.md), imports of tests/, notebooks/ and tools/.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import import_graph  # noqa: E402


def test_mk_has_no_import_cycle():
    arrows = import_graph.imports(import_graph.modules())
    knots = import_graph.cycles(arrows)
    assert not knots, [[a for a in arrows if a[0] in k and a[1] in k] for k in knots]


def test_mk_has_no_type_checking_import():
    late = [a for a in import_graph.imports(import_graph.modules()) if a[2] == "typing"]
    assert not late, late


def test_a_cycle_held_open_by_a_late_import_is_found(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "low.py").write_text("def f():\n    from pkg.sub import high  # dodge\n")
    (package / "sub" / "high.py").write_text("from .. import low\n")
    (package / "alone.py").write_text("import pkg.low\n")
    known = import_graph.modules(tmp_path, "pkg")
    arrows = import_graph.imports(known)
    assert ("pkg.low", "pkg.sub.high", "function", 2) in arrows
    assert ("pkg.sub.high", "pkg.low", "top", 1) in arrows
    assert import_graph.cycles(arrows) == [["pkg.low", "pkg.sub.high"]]
