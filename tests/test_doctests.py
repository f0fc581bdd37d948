"""Every docstring example in the ``edgemtp`` namespace runs and prints what it shows.

Modules are found by walking the package folders, so a new module's examples are checked
without editing this file. A module is imported only if its source holds an example, so
backends whose heavy dependency is absent are not touched.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pkgutil
from pathlib import Path

import pytest

import edgemtp

SUBPACKAGES = ("edgemtp.export", "edgemtp.runtimes", "edgemtp.models", "edgemtp.tools")


def _module_names() -> list[str]:
    names = ["edgemtp"]
    roots = [("edgemtp", list(edgemtp.__path__))]
    for sub in SUBPACKAGES:
        spec = importlib.util.find_spec(sub)
        if spec is not None and spec.submodule_search_locations:
            names.append(sub)
            roots.append((sub, list(spec.submodule_search_locations)))
    for prefix, path in roots:
        for info in pkgutil.walk_packages(path, prefix + "."):
            names.append(info.name)
    return sorted(set(names))


def _with_examples() -> list[str]:
    out = []
    for name in _module_names():
        origin = importlib.util.find_spec(name).origin
        if origin and origin.endswith(".py") and ">>>" in Path(origin).read_text():
            out.append(name)
    return out


MODULES = _with_examples()


def test_the_core_modules_with_examples_are_found():
    for name in ("edgemtp.plans", "edgemtp.tree", "edgemtp.verify", "edgemtp.embeddings"):
        assert name in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:  # an optional dependency (torch, onnx, ...) is absent
        if e.name and e.name.split(".")[0] == "edgemtp":
            raise
        pytest.skip(f"{name} needs {e.name!r}, which is not installed")
    examples = [ex for t in doctest.DocTestFinder().find(module) for ex in t.examples]
    runnable = sum(1 for ex in examples if not ex.options.get(doctest.SKIP))
    # the module's source shows '>>>': an example the finder does not see (in an object the
    # module imports rather than defines, say) would silently never run
    assert examples, f"{name} shows '>>>' examples but doctest finds none of them"
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, report=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
    assert result.attempted == runnable
