"""dsv4_model's packages import one way: model <- quant <- checkpoint <- runtime <- serve (each only the ones before it),
and production code never imports the tests' oracle (dsv4_ops.reference)."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
ORDER = ("model", "quant", "checkpoint", "runtime", "serve")


def _imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_packages_import_one_way():
    bad = []
    for i, pkg in enumerate(ORDER):
        files = sorted((ROOT / "dsv4_model" / pkg).glob("*.py"))
        assert files, pkg
        for f in files:
            for mod in _imports(f):
                parts = mod.split(".")
                if parts[0] == "dsv4_model" and len(parts) > 1 and parts[1] in ORDER[i + 1:]:
                    bad.append(f"{f.relative_to(ROOT)} imports {mod}")
    assert not bad, bad


def test_production_code_does_not_import_the_reference():
    bad = [f"{f.relative_to(ROOT)}" for d in ("dsv4_model", "dsv4_export") for f in (ROOT / d).rglob("*.py")
           if any(m == "dsv4_ops.reference" or m.startswith("dsv4_ops.reference.") for m in _imports(f))]
    bad += [f"{f.relative_to(ROOT)}" for f in (ROOT / "dsv4_ops").glob("*.py")
            if any(m.startswith("dsv4_ops.reference") for m in _imports(f))]
    assert not bad, bad
