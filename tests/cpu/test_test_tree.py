"""The test tree's own rules, read from the sources (every import statement, inside functions
too): no module under tests/ imports a test module or a conftest (what two test modules share
lives in tests/helpers/, fixtures in a conftest.py, which pytest hands to the tests below it);
test modules live in tests/cpu (no GPU, no kernel compile), tests/compile (kernels compiled on
the CPU) and tests/gpu (`*_gpu.py`, marked gpu), under names unique across them (pytest imports
a test module by its file name: the directories are not packages)."""
import ast
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
DIRECTORIES = {"cpu", "compile", "gpu"}


def module_files(root: Path) -> list:
    return sorted(root.rglob("test_*.py"))


def imported(path: Path, root: Path) -> set:
    """Every module name an import statement of `path` may load: `from a import b` names a and
    a.b; relative imports are resolved against the file's place under `root`'s parent."""
    names = set()
    package = list(path.relative_to(root.parent).parent.parts)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + [base]).strip(".")
            names |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return names


def forbidden_imports(root: Path) -> list:
    """(file, module) for each import under `root` of a test module or a conftest, by any name
    it can be imported under: tests.gpu.test_x, gpu.test_x, test_x (the directory on sys.path),
    or a test module's old place (tests.test_x)."""
    stems = {p.stem for p in module_files(root)} | {"conftest"}
    found = []
    for path in sorted(root.rglob("*.py")):
        for name in sorted(imported(path, root)):
            if name.rpartition(".")[2] in stems:
                found.append(f"{path.relative_to(root.parent)} imports {name}")
    return found


def test_no_module_imports_a_test_module_or_a_conftest():
    found = forbidden_imports(TESTS)
    assert not found, "\n".join(found)


def test_the_check_sees_test_modules_imported(tmp_path):
    """Not vacuous: each way of reaching another test module (or a conftest) is found, and a
    helper's import is not."""
    root = tmp_path / "tests"
    for rel, text in (("gpu/test_a_gpu.py", "from tests.helpers.shared import x\n"),
                      ("gpu/test_b_gpu.py", "def test_b():\n    from tests.gpu.test_a_gpu import helper\n"),
                      ("gpu/test_c_gpu.py", "from tests.gpu import test_a_gpu\n"),
                      ("gpu/test_d_gpu.py", "import test_a_gpu\n"),
                      ("gpu/test_e_gpu.py", "from .test_a_gpu import helper\n"),
                      ("cpu/test_f.py", "from tests.test_a_gpu import helper\n"),
                      ("cpu/test_g.py", "from tests.conftest import kernels\n"),
                      ("helpers/shared.py", "from tests.gpu.test_a_gpu import y\n")):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    assert forbidden_imports(root) == [
        "tests/cpu/test_f.py imports tests.test_a_gpu",
        "tests/cpu/test_g.py imports tests.conftest",
        "tests/gpu/test_b_gpu.py imports tests.gpu.test_a_gpu",
        "tests/gpu/test_c_gpu.py imports tests.gpu.test_a_gpu",
        "tests/gpu/test_d_gpu.py imports test_a_gpu",
        "tests/gpu/test_e_gpu.py imports tests.gpu.test_a_gpu",
        "tests/helpers/shared.py imports tests.gpu.test_a_gpu",
    ]


def test_test_modules_have_unique_names_in_their_directories():
    modules = module_files(TESTS)
    assert modules and {p.parent.relative_to(TESTS).as_posix() for p in modules} == DIRECTORIES
    repeated = [name for name, n in Counter(p.name for p in modules).items() if n > 1]
    assert not repeated, repeated


def test_gpu_tests_are_in_tests_gpu_and_marked_gpu():
    """A `*_gpu.py` module is in tests/gpu and every module there is one, marked gpu for the
    whole module (`pytestmark`), so `-m "not gpu"` leaves all of them out."""
    for path in module_files(TESTS):
        assert (path.parent.name == "gpu") == path.stem.endswith("_gpu"), path
        if path.parent.name != "gpu":
            continue
        marks = [node.value for node in ast.parse(path.read_text()).body if isinstance(node, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)]
        assert any("pytest.mark.gpu" in ast.unparse(mark) for mark in marks), f"{path}: no pytestmark = pytest.mark.gpu"
