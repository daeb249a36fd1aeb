"""The deprecated names of the tools (pycomm.tune, .launcher, .build_info, .benchmark, .train, .testbed):
the same module objects as pycomm.tools', one DeprecationWarning naming the new module, and
``python -m <old name>`` still running the tool (one process, no MPI job)."""
import os
import subprocess
import sys
import warnings

import pytest

import pycomm
import pycomm.tools.benchmark
import pycomm.tools.build_info
import pycomm.tools.launcher
import pycomm.tools.testbed
import pycomm.tools.train
import pycomm.tools.train.cli
import pycomm.tools.tune

MODULES = ["tune", "launcher", "build_info", "benchmark"]
PACKAGES = ["train", "testbed"]
OLD = [f"pycomm.{n}" for n in MODULES + PACKAGES]


@pytest.fixture(autouse=True)
def old_names_not_loaded():
    # Each test imports the old names as if for the first time in the process.
    def forget():
        for name in [m for m in sys.modules if any(m == o or m.startswith(o + ".") for o in OLD)]:
            del sys.modules[name]
        for n in MODULES + PACKAGES:
            vars(pycomm).pop(n, None)
    forget()
    yield
    forget()


def one_warning_here(caught, new):
    found = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(found) == 1, [str(w.message) for w in found]
    assert new in str(found[0].message)
    assert found[0].filename == __file__  # blames the importing line, not pycomm


@pytest.mark.parametrize("name", MODULES)
def test_module_is_the_tools_module(name):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        __import__(f"pycomm.{name}")  # an import statement's own call: the warning names this line
        old = sys.modules[f"pycomm.{name}"]
    one_warning_here(caught, f"pycomm.tools.{name}")
    assert old is sys.modules[f"pycomm.tools.{name}"]


def test_from_import_of_an_old_module():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from pycomm.tune import available_algorithms, load_table
    one_warning_here(caught, "pycomm.tools.tune")
    assert available_algorithms is pycomm.tools.tune.available_algorithms
    assert load_table is pycomm.tools.tune.load_table


def test_train_submodules_through_the_old_name():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import pycomm.train.cli as old_cli
        from pycomm.train.loop import train
        from pycomm.train.optimizers import OPTIMIZERS
    one_warning_here(caught, "pycomm.tools.train")
    assert old_cli is pycomm.tools.train.cli
    assert train is sys.modules["pycomm.tools.train.loop"].train
    assert OPTIMIZERS is sys.modules["pycomm.tools.train.optimizers"].OPTIMIZERS
    assert sys.modules["pycomm.train.cli"] is sys.modules["pycomm.tools.train.cli"]
    assert "pycomm.train.__main__" not in sys.modules  # importing it would be running it


def test_testbed_names_and_submodules_through_the_old_name():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import pycomm.testbed as old
        from pycomm.testbed.plan import BedSpec
    one_warning_here(caught, "pycomm.tools.testbed")
    assert old.Testbed is pycomm.tools.testbed.Testbed
    assert old.main is pycomm.tools.testbed.main
    assert BedSpec is pycomm.tools.testbed.BedSpec
    assert set(old.__all__) == set(pycomm.tools.testbed.__all__)


def test_import_pycomm_loads_no_tool():
    # a fresh process: here the tools are imported already
    code = ("import sys, pycomm; pycomm.resolve_algorithm; "
            "loaded = [m for m in sys.modules if m.startswith('pycomm.') and m.split('.')[1] in "
            "('tools', 'tune', 'launcher', 'build_info', 'benchmark', 'train', 'testbed')]; "
            "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True, env=_env(), timeout=120)


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        os.path.dirname(os.path.dirname(pycomm.__file__)), os.environ.get("PYTHONPATH")])))


@pytest.mark.parametrize("name,prog", [("train", "pycomm-train"), ("testbed", "pycomm-testbed"),
                                       ("tune", "pycomm-tune"), ("launcher", "pycomm-run")])
def test_python_dash_m_old_name_runs_the_tool(name, prog):
    out = subprocess.run([sys.executable, "-m", f"pycomm.{name}", "--help"], capture_output=True, text=True,
                         env=_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: {prog}"), out.stdout[:200]
    assert f"python -m pycomm.{name} is deprecated" in out.stderr
    assert f"python -m pycomm.tools.{name}" in out.stderr
