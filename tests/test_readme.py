"""The README's first example is the quickstart script, and it runs and learns; every Python
block of the README runs as the README presents it."""

import json
import pathlib
import re
import subprocess
import sys

import pytest
from doc_blocks import chains, python_blocks

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_python_blocks():
    return python_blocks((ROOT / "README.md").read_text(), "README.md")


def _readme_first_python_block() -> str:
    return _readme_python_blocks()[0].code


def _quickstart_code() -> str:
    source = (ROOT / "examples" / "quickstart.py").read_text()
    return source.split('"""', 2)[2].lstrip("\n")


def test_readme_example_is_the_quickstart_script():
    assert _readme_first_python_block() == _quickstart_code()


def test_readme_has_exactly_two_setup_commands():
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)```", setup, re.S)
    assert len(commands) == 2
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1].strip() in ci, ".ci/run must run the README's test command"


@pytest.mark.slow
def test_quickstart_runs_and_learns():
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": ""},
    )
    assert result.returncode == 0, result.stderr
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", result.stdout)]
    assert losses[0] > 0.5 and losses[-1] < 0.1, losses
    matmul_rows = [line for line in result.stdout.splitlines() if line.startswith("dot_general")]
    # mixed_float16: every matmul multiplies float16; the two weights' gradients are written
    # in float32, the policy's reduce dtype, the rest in float16.
    dtypes = [re.findall(r"(\w+)\[", r)[:3] for r in matmul_rows]  # lhs, rhs, out
    assert len(dtypes) == 5 and all(d[:2] == ["float16", "float16"] for d in dtypes), dtypes
    assert [d[2] for d in dtypes].count("float32") == 2, dtypes
    assert "bfloat16" not in result.stdout


# Runs the blocks of one chain, given as JSON on stdin, in a fresh __main__ module: the script
# a reader would paste, with nothing of this runner's in its namespace.
_RUN_CHAIN = """
import json, sys, types

def run(blocks):
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    for line, code in blocks:
        exec(compile("\\n" * (line - 1) + code, "README.md", "exec"), main.__dict__)

run(json.loads(sys.stdin.read()))
"""


@pytest.mark.slow
def test_readme_snippets_run():
    """Every Python block of the README runs as the README presents it: each block alone, in a
    process of its own, unless it starts with ``# Continues the example above.``, which runs it
    after the block before it, in that block's process (tests/doc_blocks.py); so the README can
    only show the API that exists, and a reader can copy any block that says nothing."""
    readme_chains = chains(_readme_python_blocks())
    assert sum(map(len, readme_chains)) >= 2  # the quickstart and the Flax example
    failed = []
    for chain in readme_chains:
        result = subprocess.run(
            [sys.executable, "-c", _RUN_CHAIN],
            input=json.dumps([(block.line, block.code) for block in chain]),
            capture_output=True,
            text=True,
            timeout=600,
            cwd=ROOT,
            env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": ""},
        )
        if result.returncode != 0:
            blocks = ", ".join(str(block.number) for block in chain)
            failed.append(
                f"README.md blocks {blocks} (from line {chain[0].line}) failed:\n"
                + result.stdout[-3000:]
                + result.stderr[-5000:]
            )
    assert not failed, "\n\n".join(failed)


def test_readme_is_short_and_every_file_it_names_exists():
    """The README starts a reader and sends them on: under 200 lines, and every repository path
    it names (written as code, which a package index page shows as it is) is there."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 200
    named = set(
        re.findall(r"`((?:docs|examples|benchmarks|\.ci)/[\w./-]+|[A-Z]+\.md|LICENSE)`", text)
    )
    assert {"docs/getting_started.md", "CONTRIBUTING.md", "CHANGELOG.md", "LICENSE"} <= named
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert not missing, f"the README names files that do not exist: {missing}"
    assert "](" not in text, "links relative to the repository break on a package index page"
