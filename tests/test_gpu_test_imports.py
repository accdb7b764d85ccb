"""CPU CI: every `from amk... import name` in tests/gpu resolves. The GPU tests skip before
their imports on a machine without CUDA, so a moved or renamed module would otherwise surface
only on the H200."""
import ast
import importlib
from pathlib import Path

import pytest

GPU_TESTS = sorted((Path(__file__).parent / "gpu").glob("*.py"))


def _amk_imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("amk"):
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            yield from ((a.name, []) for a in node.names if a.name.startswith("amk"))


@pytest.mark.parametrize("path", GPU_TESTS, ids=lambda p: p.name)
def test_gpu_test_imports_resolve(path):
    assert GPU_TESTS, "tests/gpu has no test files"
    for module, names in _amk_imports(path):
        mod = importlib.import_module(module)
        for name in names:
            assert hasattr(mod, name) or importlib.util.find_spec(f"{module}.{name}"), \
                f"{path.name}: {module} has no {name}"
