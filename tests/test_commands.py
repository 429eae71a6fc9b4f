"""Every shell command the README and the guides list runs, in the order listed, on a fresh copy
of the repository: the ```bash, ```shell, ```sh and ```console blocks of README.md,
CONTRIBUTING.md and docs/*.md, one fresh copy per page (a reader follows one page at a time).

A page says how a block runs in the tests in an HTML comment on the line before it (invisible
on a package index page and in the site):

- ``<!-- tested with: FLAGS -->``: each ``examples/train_transformer.py`` command of the block
  runs with FLAGS appended (shorter runs: the last value of a flag wins); ``NAME=VALUE`` words
  before the flags set environment variables (8 CPU devices for a command written for 8).
- ``<!-- not run in tests: REASON -->``: the block is not run (a GPU's run); REASON says why.

Only the commands in ``SKIPPED`` below are left out of the blocks that run, each with its
reason: what needs the network or the test suite itself. Every other command runs, so a new
command in a guide runs here by default, and must exit with status 0.
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]

# The commands (or parts of an `&&` chain) not run, by pattern, and why. The test runs in the
# environment that runs it, with the copy first on PYTHONPATH, instead of a new venv.
SKIPPED = (
    (r"python3? -m venv \S+", "a new venv installs from the network; the test's env is used"),
    (r"\. \S+/bin/activate", "activates the venv the test does not create"),
    (r"pip install .*", "needs the network; the test's env has every extra installed"),
    (r"python -m pytest.*", "the test suite itself, which runs this test (CI runs it)"),
    (r"bash \.ci/run", "what CI runs: an hour, in fresh venvs installed from the network"),
)
MARKER = r"^<!-- (tested with|not run in tests): (.*?) -->\n"
FENCE = r"^```(?:bash|shell|sh|console)\n(.*?)^```$"
SCRIPT = "examples/train_transformer.py"


def _commands(code: str) -> list[str]:
    """The commands of a block: continuation lines joined, comments and prompts dropped."""
    code = re.sub(r"\\\n\s*", "", code)
    commands = []
    for line in code.splitlines():
        line = re.sub(r"^\$ ", "", re.sub(r"(^|\s+)#.*$", "", line)).strip()
        if line:
            commands.append(line)
    return commands


def _blocks(page: pathlib.Path) -> list[tuple[str | None, str, list[str]]]:
    """``(marker kind, marker text, commands)`` of each shell block of ``page``, in order."""
    text = page.read_text()
    found = re.finditer(f"(?:{MARKER})?{FENCE}", text, re.S | re.M)
    return [(m.group(1), m.group(2) or "", _commands(m.group(3))) for m in found]


def _skip_reason(part: str) -> str | None:
    for pattern, reason in SKIPPED:
        if re.fullmatch(pattern, part.strip()):
            return reason
    return None


def _plan(page: pathlib.Path) -> list[tuple[str, dict[str, str] | None, str]]:
    """What the test does with each command of ``page``, in order: ``(command, environment or
    None, what is run or why not)``; None means the command is not run."""
    plan = []
    for kind, text, commands in _blocks(page):
        env, flags = {}, []
        for word in text.split() if kind == "tested with" else ():
            name, eq, value = word.partition("=")
            if eq and not word.startswith("-") and not flags:
                env[name] = value
            else:
                flags.append(word)
        for command in commands:
            if kind == "not run in tests":
                plan.append((command, None, f"not run: {text}"))
                continue
            background = command.endswith("&")
            parts, skipped = [], []
            for part in command.rstrip("&").split("&&"):
                reason = _skip_reason(part)
                if reason is not None:
                    skipped.append(f"{part.strip()} ({reason})")
                    continue
                part = part.strip()
                if SCRIPT in part and flags:
                    part = f"{part} {' '.join(flags)}"
                parts.append(part)
            if not parts:
                plan.append((command, None, "not run: " + "; ".join(skipped)))
                continue
            run = " && ".join(parts) + (" &" if background else "")
            plan.append((command, env, run))
    return plan


def _documents() -> list:
    return [
        pytest.param(p.relative_to(ROOT).as_posix(), marks=pytest.mark.slow, id=p.stem)
        for p in PAGES
        if _blocks(p)
    ]


def _fresh_copy(destination: pathlib.Path) -> pathlib.Path:
    """The repository's files as a fresh clone of this working tree would hold them: the
    tracked and the untracked files git does not ignore (no runs/, no builds)."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        source = ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


def _fresh_checkout(tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict[str, str]]:
    """A fresh copy of the repository under ``tmp_path`` and the environment its commands run
    in (this Python first on the PATH, the copy importable, the CPU); skips without git."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout, to copy the repository as a clone holds it")
    copy = _fresh_copy(tmp_path / "repo")
    env = {
        "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(copy),
        "JAX_PLATFORMS": "cpu",
        "HOME": os.environ.get("HOME", str(tmp_path)),
    }
    return copy, env


def _run(command: str, env: dict[str, str], cwd: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )


@pytest.mark.parametrize("page", _documents())
def test_commands_run_in_order_on_a_fresh_copy(page, tmp_path):
    copy, base = _fresh_checkout(tmp_path)
    background: list[tuple[str, subprocess.Popen]] = []
    ran = []
    for command, env, run in _plan(ROOT / page):
        if env is None:
            print(f"{page}: {command}\n  {run}")
            continue
        print(f"{page}: {command}\n  runs: {run}")
        environment = {**base, **env}
        if run.endswith("&"):
            process = subprocess.Popen(
                ["bash", "-c", run.rstrip("& ")],
                cwd=copy,
                env=environment,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            background.append((command, process))
            continue
        result = _run(run, environment, copy)
        assert result.returncode == 0, (
            f"{page}: `{command}` (run as `{run}`) failed, after {ran}:\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        )
        for started, process in background:
            output, _ = process.communicate(timeout=900)
            assert process.returncode == 0, f"{page}: `{started}` failed:\n{output[-5000:]}"
        background = []
        ran.append(command)
    assert not background, f"{page}: a block ends with a command left in the background"


@pytest.mark.slow
def test_the_readmes_set_up_command_runs_twice_in_a_row(tmp_path):
    # People run a set-up command again (a new shell, another day): the second run must succeed
    # too, and says what it did with the first run's folder.
    copy, env = _fresh_checkout(tmp_path)
    (command, _, run), *_ = [row for row in _plan(ROOT / "README.md") if row[1] is not None]
    first, second = (_run(run, env, copy) for _ in range(2))
    for result in first, second:
        assert result.returncode == 0, f"`{command}` failed:\n{result.stderr[-3000:]}"
    assert "runs/tiny_mixed_bfloat16 holds this command's run" in second.stdout
    assert "is finished (step 4); nothing to train" in second.stdout
    assert second.stdout.endswith(first.stdout[first.stdout.index("\ndone: ") :])


def test_the_plan_of_each_page_is_read_from_the_page():
    """What runs and what does not is read from the pages' markers and SKIPPED, not guessed:
    the README's set-up and example commands run (shortened as its markers say), a GPU's run
    does not, and pip's and pytest's commands are left out with their reasons."""
    plan = _plan(ROOT / "README.md")
    runs = [run for _, env, run in plan if env is not None]
    assert runs[0] == f"python {SCRIPT} --steps 4 --eval-interval 4 --sample-bytes 16"
    assert any("--mode autocast" in run for run in runs)
    not_run = {command: why for command, env, why in plan if env is None}
    assert any("--preset small" in c and "needs a GPU" in why for c, why in not_run.items())
    assert all("pip install" not in run and "pytest" not in run for run in runs)
    distributed = _plan(ROOT / "docs" / "distributed.md")
    assert all(env for _, env, _ in distributed)  # 8 CPU devices for the --fsdp 4 run
    assert distributed[1][2].endswith(" &")
    assert _commands("a \\\n  --b 1  # note\n$ c\n") == ["a --b 1", "c"]
