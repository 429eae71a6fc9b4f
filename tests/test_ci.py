"""CI tests the versions mpjax claims: pyproject.toml's floors are what .ci/oldest.txt pins."""

import ast
import pathlib
import re
import shlex
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _floors() -> dict[str, str]:
    """``{package: oldest version}`` from the dependencies and the extras CI installs."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floors = {}
    extras = project["optional-dependencies"]
    installed = extras["test"] + extras["flax"] + extras["jmp"] + extras["equinox"] + extras["bench"]
    for spec in project["dependencies"] + installed:
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)>=([0-9.]+)", spec)
        assert match, f"{spec!r}: every dependency needs a floor, written name>=version"
        floors[match.group(1)] = match.group(2)
    return floors


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / ".ci" / "oldest.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name] = version
    return pins


def _release(version: str) -> tuple[int, ...]:
    """``"8.0.0"`` and ``"8"`` alike as ``(8,)``."""
    parts = [int(part) for part in version.split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def test_oldest_pins_are_the_floors():
    floors, pins = _floors(), _pins()
    assert set(floors) <= set(pins), f"CI never runs the floors of {set(floors) - set(pins)}"
    for name, floor in floors.items():
        assert _release(pins[name]) == _release(floor), name
    # jaxlib is not a dependency of its own, but it moves with jax.
    assert set(pins) - set(floors) == {"jaxlib"} and pins["jaxlib"] == pins["jax"]


def test_ci_runs_the_oldest_pins_on_the_oldest_python():
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    oldest = re.fullmatch(r">=(3\.\d+)", requires).group(1)
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(rf"^suite oldest {re.escape(oldest)} \.ci/oldest\.txt ", ci, re.M)
    examples = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["examples"]
    assert f"orbax-checkpoint>={_pins()['orbax-checkpoint']}" in examples


def test_the_dev_tools_are_pinned_and_ci_runs_the_checks():
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][
        "dev"
    ]
    names = set()
    for spec in dev:
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==[0-9][0-9A-Za-z.]*", spec)
        assert match, f"{spec!r}: a dev tool is pinned exactly, written name==version"
        names.add(match.group(1).lower())
    assert {"ruff", "mypy", "sphinx"} <= names
    checks = (ROOT / ".ci" / "checks").read_text()
    for command in ("ruff check", "ruff format --check", "mypy", "sphinx -E -W"):
        assert command in checks, command
    assert re.search(r"^bash \.ci/checks\b", (ROOT / ".ci" / "run").read_text(), re.M)


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _imported_packages() -> set[str]:
    """The top-level packages that mpjax's modules import, standard library left out."""
    found = set()
    for path in (ROOT / "mpjax").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"mpjax", "__future__"}


def _names(specs: list[str]) -> set[str]:
    return {re.split(r"[<>=\[ ]", spec, maxsplit=1)[0] for spec in specs}


def test_required_dependencies_are_what_the_package_imports_and_the_rest_are_extras():
    project = _project()
    extras = project["optional-dependencies"]
    required = _names(project["dependencies"])
    optional = _names(extras["flax"] + extras["jmp"] + extras["equinox"])
    assert required == {"jax", "optax", "numpy"} and optional == {"flax", "jmp", "equinox"}
    assert _imported_packages() == required | optional
    # The tests exercise the optional parts; the examples are Flax models.
    assert set(extras["flax"] + extras["jmp"] + extras["equinox"]) <= set(extras["test"])
    assert set(extras["flax"]) <= set(extras["examples"])


def test_the_readme_command_leaves_out_the_slow_tests_and_ci_runs_them():
    """The README's command runs the fast suite (addopts deselects the slow marker); CI runs
    it and then ``-m slow`` in the same venv, in both suites; the README says how."""
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    ini = options["ini_options"]
    addopts = shlex.split(ini["addopts"])
    assert addopts[addopts.index("-m") + 1] == "not slow"
    assert any(marker.startswith("slow:") for marker in ini["markers"])
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^SLOW_TESTS='\. \.venv/bin/activate && python -m pytest -m slow'$", ci, re.M)
    body = ci.split("\nsuite() {", 1)[1].split("\n}\n", 1)[0]
    readme_run = body.index('bash -c "${README_TESTS')
    slow_run = body.index('bash -c "$SLOW_TESTS"')
    assert readme_run < slow_run and "slow_rc -ne 0" in body
    assert len(re.findall(r"^suite \w+ ", ci, re.M)) == 2
    assert "python -m pytest -m slow" in (ROOT / "README.md").read_text()
