"""CI tests the versions mpjax claims: pyproject.toml's floors are what .ci/oldest.txt pins."""

import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _floors() -> dict[str, str]:
    """``{package: oldest version}`` from the dependencies and the test extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floors = {}
    for spec in project["dependencies"] + project["optional-dependencies"]["test"]:
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
        "optional-dependencies"]["examples"]
    assert f"orbax-checkpoint>={_pins()['orbax-checkpoint']}" in examples


def test_the_dev_tools_are_pinned_and_ci_runs_the_checks():
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["dev"]
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
