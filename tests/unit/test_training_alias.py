"""pycomm.algorithms, the deprecated name of pycomm.training: the same module objects, one DeprecationWarning
naming the new package, submodules through the old name (one process, no MPI job)."""
import os
import pkgutil
import subprocess
import sys
import warnings

import pytest

import pycomm
import pycomm.training


@pytest.fixture(autouse=True)
def old_name_not_loaded():
    # Each test imports the old name as if for the first time in the process.
    def forget():
        for name in [m for m in sys.modules if m == "pycomm.algorithms" or m.startswith("pycomm.algorithms.")]:
            del sys.modules[name]
        vars(pycomm).pop("algorithms", None)
    forget()
    yield
    forget()


def deprecations(caught):
    return [w for w in caught if issubclass(w.category, DeprecationWarning)]


def assert_one_warning_here(caught):
    found = deprecations(caught)
    assert len(found) == 1, [str(w.message) for w in found]
    assert "pycomm.training" in str(found[0].message)
    assert found[0].filename == __file__  # blames the importing line, not pycomm


def test_package_is_pycomm_training():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import pycomm.algorithms
    assert_one_warning_here(caught)
    assert pycomm.algorithms is pycomm.training
    assert pycomm.algorithms.create is pycomm.training.create
    assert pycomm.algorithms.ALGORITHMS is pycomm.training.ALGORITHMS


def test_submodule_through_the_old_name():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import pycomm.algorithms.ssgd as old_ssgd
        from pycomm.algorithms.bmuf import BMUF
    assert_one_warning_here(caught)
    assert old_ssgd is pycomm.training.ssgd
    assert old_ssgd.SSGD is pycomm.training.ssgd.SSGD
    assert BMUF is pycomm.training.bmuf.BMUF
    assert sys.modules["pycomm.algorithms.ssgd"] is sys.modules["pycomm.training.ssgd"]


def test_every_submodule_is_the_same_object():
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        import pycomm.algorithms  # noqa: F401
    names = [i.name for i in pkgutil.iter_modules(pycomm.training.__path__)]
    assert "ec_dnn" in names and "registry" in names
    for name in names:
        assert sys.modules[f"pycomm.algorithms.{name}"] is sys.modules[f"pycomm.training.{name}"], name


def test_attribute_of_pycomm_and_from_import():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = pycomm.algorithms
        again = pycomm.algorithms
    assert_one_warning_here(caught)
    assert old is again is pycomm.training

    vars(pycomm).pop("algorithms")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from pycomm import algorithms
    assert_one_warning_here(caught)
    assert algorithms is pycomm.training


def test_import_pycomm_does_not_load_the_old_name():
    # a fresh process: here pycomm is imported already
    code = ("import sys, pycomm; assert 'pycomm.algorithms' not in sys.modules; "
            "assert 'algorithms' not in vars(pycomm); assert pycomm.training.ssgd.SSGD")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        os.path.dirname(os.path.dirname(pycomm.__file__)), os.environ.get("PYTHONPATH")])))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
