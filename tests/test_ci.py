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
    installed = (
        extras["test"]
        + extras["flax"]
        + extras["jmp"]
        + extras["equinox"]
        + extras["bench"]
        + extras["docs"]
    )
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
    assert {"ruff", "mypy", "sphinx", "sphinx-book-theme", "myst-parser"} <= names
    checks = (ROOT / ".ci" / "checks").read_text()
    for command in ("ruff check", "ruff format --check", "mypy", "sphinx -E -n -W"):
        assert command in checks, command
    assert re.search(r"^job checks \.ci/checks$", (ROOT / ".ci" / "run").read_text(), re.M)


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _imported_packages() -> set[str]:
    """The top-level packages that mpjax's modules import, standard library left out."""
    found = set()
    for path in (ROOT / "mpjax").rglob("*.py"):
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
    parts = extras["flax"] + extras["jmp"] + extras["equinox"] + extras["plot"]
    optional = _names(parts)
    assert required == {"jax", "optax", "numpy"}
    assert optional == {"flax", "jmp", "equinox", "matplotlib"}
    assert _imported_packages() == required | optional
    # The tests exercise the optional parts; the examples are Flax models.
    assert set(parts) <= set(extras["test"])
    assert set(extras["flax"]) <= set(extras["examples"])


def test_the_readme_command_leaves_out_the_slow_tests_and_ci_runs_them():
    """The README's command runs the fast suite (addopts deselects the slow marker); CI runs
    it and then ``-m slow`` in the same venv, in the newest suite (the oldest runs the fast
    suite only, to keep CI under the hour); the README says how."""
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    ini = options["ini_options"]
    addopts = shlex.split(ini["addopts"])
    assert addopts[addopts.index("-m") + 1] == "not slow"
    assert any(marker.startswith("slow:") for marker in ini["markers"])
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(
        r"^SLOW_TESTS='\. \.venv/bin/activate && python -m pytest -m slow -n 2 --dist loadfile'$",
        ci,
        re.M,
    )
    body = ci.split("\nsuite() {", 1)[1].split("\n}\n", 1)[0]
    readme_run = body.index('bash -c "${README_TESTS')
    slow_run = body.index('bash -c "$SLOW_TESTS"')
    assert readme_run < slow_run and "slow_rc -ne 0" in body
    suites = re.findall(r"^(?:slow=(\d)\n(?:.*\n)*?)?suite (\w+) ", ci, re.M)
    assert [name for _, name in suites] == ["newest", "oldest"]
    # The newest suite runs the slow tests; the oldest is marked out of them.
    oldest = ci.split("\nsuite oldest ", 1)[0].rsplit("\nsuite newest ", 1)[1]
    assert "\nslow=0\n" in oldest and "\nslow=1" in ci.split("\nsuite oldest ", 1)[1]
    assert "python -m pytest -m slow" in (ROOT / "README.md").read_text()


def test_the_package_carries_its_license_and_what_its_tests_need():
    """The metadata names the license as an SPDX expression and ships its text; the sdist holds
    the files the tests read (conftest, examples, benchmarks, CI scripts, README); CI builds the
    package, checks it with twine, installs the wheel bare and with each extra, and runs the
    oldest suite in the unpacked sdist."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert not any(c.startswith("License ::") for c in project["classifiers"])  # PEP 639
    python = {c.rsplit(" ", 1)[1] for c in project["classifiers"] if re.search(r"3\.\d+$", c)}
    assert min(python, key=lambda v: int(v.split(".")[1])) == project["requires-python"][2:]
    manifest = (ROOT / "MANIFEST.in").read_text().splitlines()
    grafted = {line.split()[1] for line in manifest if line.startswith("graft ")}
    assert {"tests", "examples", "benchmarks", "docs", ".ci"} <= grafted
    included = {f for line in manifest if line.startswith("include ") for f in line.split()[1:]}
    assert {"conftest.py", "README.md", "LICENSE", "CHANGELOG.md"} <= included
    assert all((ROOT / f).is_file() for f in included)
    package = (ROOT / ".ci" / "package").read_text()
    for step in ("build", "core", "extras", "unpack"):
        assert re.search(rf"^step [\w-]+ {step}$", package, re.M), step
    assert 'twine" check --strict' in package
    for extra in ("flax", "equinox", "jmp"):
        assert f'"$wheel[{extra}]"' in package and extra in project["optional-dependencies"]
    # The package is built first, and the oldest suite runs the README's command in the sdist.
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.index("\njob package .ci/package\n") < ci.index("\nsuite newest ")
    oldest = ci.split("\nsuite oldest ", 1)[0].rsplit("\n", 2)[-1]
    assert oldest.startswith("suite_dir=$(cat .ci/package-work/sdist-dir")
    assert '(cd "$dir" && env "${vars[@]}" bash -c "${README_TESTS' in ci


def test_the_docs_build_on_the_oldest_and_newest_python_with_and_without_the_extras():
    """The docs extra gives ranges that install on every supported Python, and the dev extra
    pins versions inside them (.ci/checks builds with those, with every extra, on the newest
    Python); .ci/docs builds on the oldest Python with the oldest pins and the extras the guides
    use, and on the newest with the docs extra alone; .ci/run runs it after the checks."""
    project = _project()
    extras = project["optional-dependencies"]
    floors = {}
    for spec in extras["docs"]:
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)>=([0-9.]+)", spec)
        assert match, f"{spec!r}: a docs tool is given as a range, written name>=version"
        floors[match.group(1)] = match.group(2)
    assert set(floors) == {"sphinx", "sphinx-book-theme", "myst-parser"}
    pins = dict(spec.split("==") for spec in extras["dev"])
    for name, floor in floors.items():
        assert _release(pins[name]) >= _release(floor), name
    requires = re.fullmatch(r">=(3\.\d+)", project["requires-python"]).group(1)
    newest = max(
        (c.rsplit(" ", 1)[1] for c in project["classifiers"] if re.search(r" 3\.\d+$", c)),
        key=lambda v: int(v.split(".")[1]),
    )
    script = (ROOT / ".ci" / "docs").read_text()
    builds = re.findall(r"^build (\w+) (\S+) (\S+) (\S+)$", script, re.M)
    assert (requires, ".ci/oldest.txt", '"docs,flax,equinox,jmp"') in [b[1:] for b in builds]
    assert (newest, '""', '"docs"') in [b[1:] for b in builds]
    assert 'python" -m sphinx -E -n -W' in script and 'echo "=== Docs"' in script
    conf = (ROOT / "docs" / "conf.py").read_text()
    assert 'OPTIONAL_EXTRAS = ("flax", "equinox", "jmp")' in conf
    assert set(_names(extras["flax"] + extras["equinox"] + extras["jmp"])) == {
        "flax",
        "equinox",
        "jmp",
    }
    run = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^job docs \.ci/docs$", run, re.M)
    assert run.index("\njob checks .ci/checks\n") < run.index("\njob docs .ci/docs\n")
