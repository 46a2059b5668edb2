"""conf/ and recipes/ sit at the top of the repository and install inside the package (as
rapidformer.conf and rapidformer.recipes, pyproject.toml): a wheel and an editable install both
find them from any working directory.

The wheels are built by setuptools' own build hooks (what `pip install .` and `pip install -e .`
call, with no build isolation) from a copy of the sources, and installed by unpacking them, which
is all pip does with a wheel: no network, no new environment, a few seconds.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = ["pyproject.toml", "README.md", "rapidformer", "conf", "recipes"]
# run in another working directory with only the install under test and its dependencies on the
# path: `python -S` processes no .pth of the environment (its own install of rapidformer)
CHECK = r"""
import site, sys
site.addsitedir(sys.argv[1])  # the install under test, with its .pth (an editable finder)
sys.path.append(sys.argv[2])  # the dependencies, without their .pth files
editable = [f for f in sys.meta_path if getattr(f, "__module__", "").startswith("__editable__")]
sys.meta_path[:0] = editable  # ahead of a rapidformer that the dependencies' folder may hold
import rapidformer.conf, rapidformer.recipes
from rapidformer.config.compose import compose, group_options
from rapidformer.preflight import settle
print(rapidformer.conf.__file__)
print(rapidformer.recipes.__file__)
print(" ".join(group_options("recipe")))
print(" ".join(group_options("model")))
_, cfg = settle(compose(["+recipe=bert_mrpc"]), "out")
print(cfg.recipe, cfg.model.name)
"""


def source_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    """(source copy, wheel, editable wheel)."""
    if importlib.util.find_spec("setuptools.command.bdist_wheel") is None:
        pytest.skip("needs setuptools >= 70.1 (its own bdist_wheel)")
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy(REPO / name, src / name)
    build = ("from setuptools import build_meta as b; "
             "b.build_wheel('../wheel'); b.build_editable('../editable')")
    result = subprocess.run([sys.executable, "-c", build], cwd=src, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = (tmp / "wheel").glob("*.whl")
    (editable,) = (tmp / "editable").glob("*.whl")
    return src, wheel, editable


def run_check(site_dir: Path, tmp_path: Path) -> list[str]:
    import hydra

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    deps = str(Path(hydra.__file__).resolve().parents[1])
    result = subprocess.run([sys.executable, "-S", "-c", CHECK, str(site_dir), deps],
                            cwd=elsewhere, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout.splitlines()


def same(path: str, expected: Path) -> bool:
    return Path(path).resolve() == expected.resolve()


def expected_options(src: Path) -> tuple[str, str]:
    return (" ".join(sorted(p.stem for p in (src / "recipes").glob("*.yaml"))),
            " ".join(sorted(p.stem for p in (src / "conf" / "model").glob("*.yaml"))))


def test_the_wheel_holds_conf_and_recipes_inside_the_package_and_finds_them(wheels, tmp_path):
    src, wheel, _ = wheels
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"rapidformer/conf/{f}" for f in source_files(src / "conf")}
    expected |= {f"rapidformer/recipes/{f}" for f in source_files(src / "recipes")}
    assert "rapidformer/conf/config.yaml" in expected and expected <= names, \
        sorted(expected - names)
    assert not [n for n in names if n.startswith(("conf/", "recipes/"))]  # nothing top-level
    missing = [f"rapidformer/{f}" for f in source_files(src / "rapidformer")
               if f.endswith(".py") and f"rapidformer/{f}" not in names]
    assert not missing, (f"{missing}: not in the wheel; add their packages to [tool.setuptools] "
                         f"packages in pyproject.toml")
    site_dir = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site_dir)
    conf, recipes, recipe_names, models, composed = run_check(site_dir, tmp_path)
    assert same(conf, site_dir / "rapidformer" / "conf" / "__init__.py")
    assert same(recipes, site_dir / "rapidformer" / "recipes" / "__init__.py")
    assert (recipe_names, models) == expected_options(src)
    assert composed == "bert_mrpc bert_base_cased"


def test_the_editable_install_maps_the_packages_to_conf_and_recipes(wheels, tmp_path):
    src, _, editable = wheels
    site_dir = tmp_path / "site"
    zipfile.ZipFile(editable).extractall(site_dir)
    conf, recipes, recipe_names, models, composed = run_check(site_dir, tmp_path)
    assert same(conf, src / "conf" / "__init__.py")
    assert same(recipes, src / "recipes" / "__init__.py")
    assert (recipe_names, models) == expected_options(src)
    assert composed == "bert_mrpc bert_base_cased"


def test_a_leftover_conf_folder_of_the_old_layout_is_named_with_the_fix(monkeypatch):
    """A checkout from before the move keeps rapidformer/conf/__pycache__/: that folder would be
    imported as an empty namespace package in place of the editable install's conf/."""
    import types

    from rapidformer.config.compose import group_options
    from rapidformer.errors import NotAvailableError

    stale = types.ModuleType("rapidformer.conf")
    stale.__path__ = ["checkout/rapidformer/conf"]
    monkeypatch.setitem(sys.modules, "rapidformer.conf", stale)
    with pytest.raises(NotAvailableError, match="folder checkout/rapidformer/conf, without "
                                                "__init__.py: a leftover .*; delete it"):
        group_options("model")
