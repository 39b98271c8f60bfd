"""The benchmarks are a small package the tests import, never the reverse: no benchmark imports a test module or puts
``tests/`` on its path (a benchmark that did would run the tests' code and break when a test moves)."""

import ast
from pathlib import Path

ROOT = Path(__file__).parents[2]


def names_in_tests() -> set[str]:
    """The names ``tests/`` can be imported by: its top-level modules and packages."""
    return {p.stem for p in (ROOT / "tests").iterdir() if p.suffix == ".py" or (p.is_dir() and p.name != "__pycache__")}


def imports_of_tests(source: str, tests: set[str]) -> list[str]:
    """What in ``source`` reaches into the tests: imports of their modules, and path edits naming ``tests``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in tests]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in tests:
            found.append(node.module)
        elif isinstance(node, ast.Constant) and node.value == "tests":
            line = source.splitlines()[node.lineno - 1]
            if "sys.path" in line:
                found.append(line.strip())
    return found


def test_no_benchmark_imports_a_test():
    tests = names_in_tests()
    offenders = {
        str(path.relative_to(ROOT)): hits
        for path in sorted((ROOT / "benchmarks").rglob("*.py"))
        if (hits := imports_of_tests(path.read_text(), tests))
    }
    assert offenders == {}
    # control: the import this test exists to refuse (metric_fidelity.py's before #45) is found
    old = 'TESTS = "tests"\nsys.path[:0] = [str(ROOT / "tests")]\n'
    old += "import test_metrics_fidelity as ref\nfrom helpers import x\n"
    assert sorted(imports_of_tests(old, tests | {"test_metrics_fidelity"})) == [
        "helpers",
        'sys.path[:0] = [str(ROOT / "tests")]',
        "test_metrics_fidelity",
    ]
