"""Drain strategies as Twisted plugins: discovery, interfaces, names, selection by name, a third-party one."""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import twisted.plugins
from twisted.plugin import IPlugin, getPlugins
from zope.interface.verify import verifyObject

from ztwisted.drain.registry import UnknownStrategy, describe, installed_strategies, select
from ztwisted.drain.strategies import BUILT_IN
from ztwisted.interfaces import IDrainStrategy
from ztwisted.tap import Options

ROOT = Path(__file__).resolve().parents[2]
BUILT_IN_NAMES = {"immediate", "goaway-on-start", "last-mile", "client-evict", "gradual"}
EXAMPLE = ROOT / "examples" / "custom_strategy"


def found_plugins() -> list:
    return list(getPlugins(IDrainStrategy, twisted.plugins))


def strategies_in(module) -> list:
    return [value for value in vars(module).values() if IDrainStrategy.providedBy(value)]


def test_every_built_in_is_found_through_getPlugins():
    names = [plugin.name for plugin in found_plugins()]
    assert BUILT_IN_NAMES <= set(names)
    assert {cls.name for cls in BUILT_IN} == BUILT_IN_NAMES


def test_the_plugin_module_imports_and_getPlugins_finds_all_of_it():
    # getPlugins only logs a plugin module that fails to import: importing it here makes that a failure.
    module = importlib.import_module("twisted.plugins.ztwisted_strategies")
    declared = strategies_in(module)
    found_built_ins = [plugin for plugin in found_plugins() if type(plugin) in BUILT_IN]
    assert {id(s) for s in declared} == {id(p) for p in found_built_ins}
    assert sorted(type(s).__name__ for s in declared) == sorted(cls.__name__ for cls in BUILT_IN)


def test_the_repository_plugin_file_is_the_one_installed():
    spec = importlib.util.spec_from_file_location(
        "_ztwisted_strategies_from_repo", ROOT / "plugins" / "ztwisted_strategies.py"
    )
    from_repo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(from_repo)
    installed = importlib.import_module("twisted.plugins.ztwisted_strategies")
    assert sorted(s.name for s in strategies_in(from_repo)) == sorted(s.name for s in strategies_in(installed))


@pytest.mark.parametrize("name", sorted(BUILT_IN_NAMES))
def test_each_built_in_provides_both_interfaces(name):
    strategy = installed_strategies()[name]
    assert verifyObject(IPlugin, strategy)
    assert verifyObject(IDrainStrategy, strategy)


def test_strategy_names_are_unique_and_selectable():
    names = [plugin.name for plugin in found_plugins()]
    assert len(names) == len(set(names)), f"two plugins share a name: {sorted(names)}"
    for plugin in found_plugins():
        name = plugin.name
        assert name and name == name.lower() and not set(name) & set(",+ \t"), (
            f"{name!r} cannot be given to --drain-strategy"
        )
        assert select(name) == [plugin]
        assert plugin.description and "\n" not in plugin.description


@pytest.mark.parametrize("name", sorted(BUILT_IN_NAMES))
def test_each_built_in_is_documented_under_its_name(name):
    page = ROOT / "docs" / "strategies" / f"{name}.rst"
    assert page.exists(), f"no {page.relative_to(ROOT)}"
    assert page.read_text().splitlines()[0].startswith(f"``{name}``")
    assert f"strategies/{name}" in (ROOT / "docs" / "draining.rst").read_text()


def test_help_lists_every_strategy_with_its_description():
    text = describe()
    for name, strategy in installed_strategies().items():
        assert any(
            line.split() and line.split()[0] == name and line.endswith(strategy.description)
            for line in text.splitlines()
        )


# -- selection by name ----------------------------------------------------------------


def test_select_composes_with_commas_or_plus_signs_in_the_order_given():
    available = installed_strategies()
    expected = [available["client-evict"], available["last-mile"]]
    assert select("client-evict,last-mile") == expected
    assert select("client-evict+last-mile") == expected
    assert select(" client-evict , last-mile ") == expected
    assert select("last-mile,client-evict") == expected[::-1]


def test_select_keeps_one_of_each_name():
    available = installed_strategies()
    assert select("immediate,client-evict,immediate") == [available["immediate"], available["client-evict"]]


def test_an_unknown_name_lists_the_installed_ones():
    with pytest.raises(UnknownStrategy) as raised:
        select("client-evict,nonesuch")
    message = str(raised.value)
    assert message.startswith("unknown drain strategy nonesuch; installed: ")
    assert all(name in message for name in installed_strategies())


def test_several_unknown_names_are_all_named():
    with pytest.raises(UnknownStrategy, match="unknown drain strategies x, y; installed: "):
        select("x+immediate+y")


@pytest.mark.parametrize("spec", ["", ",", " + "])
def test_an_empty_spec_says_to_choose(spec):
    with pytest.raises(UnknownStrategy, match="no drain strategy named; choose from: .*immediate"):
        select(spec)


def test_select_from_an_explicit_set():
    one, two = object(), object()
    assert select("b,a", {"a": one, "b": two}) == [two, one]
    with pytest.raises(UnknownStrategy, match="installed: a, b$"):
        select("c", {"a": one, "b": two})


def test_the_option_defaults_to_immediate_and_rejects_unknown_names():
    options = Options()
    assert options["drain-strategy"] == "immediate"
    with pytest.raises(SystemExit, match="unknown drain strategy bogus; installed: .*last-mile"):
        options.parseOptions(["--drain-strategy", "bogus"])


def test_the_option_help_lists_the_strategies_and_exits(capsys):
    with pytest.raises(SystemExit) as exited:
        Options().parseOptions(["--drain-strategy", "help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in BUILT_IN_NAMES)


# -- a third-party strategy --------------------------------------------------------------


@pytest.fixture
def example_on_path(tmp_path, monkeypatch):
    """The example package as if installed: on sys.path, its twisted/plugins in twisted.plugins.__path__.

    A copy, so that the dropin.cache Twisted writes does not land in the repository.
    """
    copy = tmp_path / "custom_strategy"
    shutil.copytree(EXAMPLE, copy, ignore=shutil.ignore_patterns("__pycache__", "dropin.cache", "tests"))
    monkeypatch.syspath_prepend(str(copy))
    monkeypatch.setattr(twisted.plugins, "__path__", [*twisted.plugins.__path__, str(copy / "twisted" / "plugins")])
    yield copy
    for name in ("goaway_when_idle", "twisted.plugins.goaway_when_idle_plugin"):
        sys.modules.pop(name, None)


def test_a_third_party_strategy_is_found_verified_and_composed_with_built_ins(example_on_path):
    assert not (EXAMPLE / "twisted" / "__init__.py").exists()
    assert not (EXAMPLE / "twisted" / "plugins" / "__init__.py").exists()
    available = installed_strategies()
    strategy = available["goaway-when-idle"]
    assert verifyObject(IPlugin, strategy)
    assert verifyObject(IDrainStrategy, strategy)
    assert select("goaway-when-idle,immediate") == [strategy, available["immediate"]]
    assert "goaway-when-idle" in describe()


def test_the_example_package_tests_pass():
    """The tests that docs/write-your-own-strategy.rst shows, run as the example's own suite."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLE)],
        cwd=EXAMPLE,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert " passed" in result.stdout and "failed" not in result.stdout
