"""Every guide of the documentation site runs: the ```python blocks of each page under docs/,
each the way the page presents it, so a guide can only show the API that exists and the outputs
it prints. A reader copies one block: a block runs alone, in a fresh namespace, unless it starts
with ``# Continues the example above.``, which runs it after the block before it, in that
block's namespace (tests/doc_blocks.py groups a page's blocks into these chains). Every block,
of the guides and the README, defines or continues every name it uses, checked statically. A
block that needs an optional extra that is not installed is skipped with the rest of its chain
(later blocks may use its names), naming the extra; pages whose code trains or compiles whole
models are marked slow. The documentation build itself is tested without the extras: their API
pages are generated against mocks."""

import contextlib
import importlib.util
import pathlib
import re
import runpy
import subprocess
import sys
import types
import warnings
import zlib

import jax
import pytest
from doc_blocks import (
    MARKER,
    Block,
    bound_names,
    chains,
    python_blocks,
    undefined_names,
    used_names,
)

import mpjax

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _module_missing(module: str):
    def reason() -> str | None:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package is missing
            found = False
        return None if found else f"{module} is not installed"

    return reason


# What a block needs, recognised by its code: (the pattern, what installs it, a function that
# says why it is unavailable, or None).
NEEDS = (
    (
        r"^\s*(import|from) flax\b|mpjax\.(linen|nnx)\b|from mpjax import (linen|nnx)\b",
        "the flax extra",
        _module_missing("flax"),
    ),
    (
        r"^\s*(import|from) equinox\b|mpjax\.equinox\b",
        "the equinox extra",
        _module_missing("equinox"),
    ),
    (r"^\s*(import|from) jmp\b|\bto_jmp\(|\bfrom_jmp\(", "the jmp extra", _module_missing("jmp")),
    (r"^\s*(import|from) orbax\b", "the test extra", _module_missing("orbax.checkpoint")),
    (
        r"\bmpjax\.plan\((?![^\n]*\"v\d)",
        "the cuda12 extra (JAX's CUDA plugin)",
        mpjax.plan_unavailable,
    ),
    (
        r"\bmpjax\.plan(_mesh)?\([^\n]*\"v\d",
        "the tpu extra (libtpu)",
        lambda: mpjax.plan_unavailable("v5p"),
    ),
)

# Pages whose code trains or compiles several models (5 to 15 s each on 2 CPU cores with the
# newest JAX, more with the oldest) run with the slow tests (-m slow); the default run keeps the
# pages that take a few seconds.
SLOW = {
    "attention.md": "compiles Flax attention forward and backward",
    "checkpoints.md": "trains, saves and restores with orbax",
    "distributed.md": "compiles sharded train steps",
    "equinox.md": "trains an Equinox model",
    "fp8.md": "compiles fp8 training steps",
    "from_pytorch.md": "compiles a float16 train step twice",
    "getting_started.md": "trains 300 steps and compiles a Flax model",
    "inspection.md": "compiles a gradient and runs the precision doctor",
    "linen.md": "compiles several Flax models forward and backward",
    "moe.md": "compiles a mixture of experts' grouped GEMMs forward and backward",
    "nnx.md": "compiles NNX train steps",
    "optimizer_memory.md": "runs 300 optimizer updates eagerly",
    "plan.md": "compiles training steps for an H100 and a TPU",
    "pods.md": "compiles sharded training steps for TPU slices and GPU clusters",
}


# Pages whose code a test of their own runs, with more asserts: not run twice.
OWN_TESTS = {"precision_doctor.md": "test_precision_doctor_guide.py"}


def _blocks(page: pathlib.Path) -> list[Block]:
    """Each ```python block of ``page`` (README.md or a page under docs/)."""
    return python_blocks(page.read_text(), page.relative_to(ROOT).as_posix())


def _pages() -> list[pathlib.Path]:
    return sorted(p for p in DOCS.glob("*.md") if _blocks(p) and p.name not in OWN_TESTS)


def _missing(code: str) -> str | None:
    """What ``code`` needs and this environment lacks, and why; or None."""
    for pattern, extra, unavailable in NEEDS:
        if re.search(pattern, code, re.M):
            reason = unavailable()
            if reason is not None:
                return f"{extra}: {reason}"
    return None


@contextlib.contextmanager
def _reader_environment(name: str):
    """A fresh module to run the page in, with JAX's standard dtype promotion (the test suite's
    is strict; a reader's is not)."""
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses (Flax modules) look their module up
    try:
        with warnings.catch_warnings(), jax.numpy_dtype_promotion("standard"):
            yield module.__dict__
    finally:
        del sys.modules[name]


def _param(page: pathlib.Path):
    if page.name in SLOW:
        return pytest.param(page.name, marks=pytest.mark.slow, id=page.stem)
    return pytest.param(page.name, id=page.stem)


@pytest.mark.parametrize("name", [_param(p) for p in _pages()])
def test_guide_runs(name):
    """Each chain of the page's blocks runs in a fresh module, as a reader who copies its first
    block and the blocks that continue it would run them."""
    page = DOCS / name
    not_run = []
    for c, chain in enumerate(chains(_blocks(page)), 1):
        with _reader_environment(f"docs_{page.stem}_chain{c}") as namespace:
            for i, block in enumerate(chain):
                extra = _missing(block.code)
                if extra is not None:
                    numbers = [b.number for b in chain[i:]]
                    not_run.append(
                        f"block{'s' if len(numbers) > 1 else ''} "
                        f"{', '.join(map(str, numbers))} (from line {block.line}) of chain {c}, "
                        f"since block {block.number} needs {extra}"
                    )
                    break
                # Padded so that a traceback names the page's own line numbers.
                exec(compile(block.source(), str(page), "exec"), namespace)
    if not_run:
        pytest.skip(f"docs/{name}: not run: {'; '.join(not_run)}; the page's other blocks ran")


def _reader_pages() -> list[pathlib.Path]:
    """The pages whose ```python blocks a reader copies: the README and every guide."""
    return [ROOT / "README.md", *sorted(p for p in DOCS.glob("*.md") if _blocks(p))]


@pytest.mark.parametrize(
    "page", [pytest.param(p, id=p.relative_to(ROOT).as_posix()) for p in _reader_pages()]
)
def test_every_block_defines_or_continues_the_names_it_uses(page):
    """Read without running anything: a block that starts a chain binds every name it uses
    (its imports and inputs), a block that continues one uses only names its chain's blocks
    bind, and the names a marker lists, ``(model, x)``, are ones the chain binds before the
    block and the block uses."""
    problems = []
    for chain in chains(_blocks(page)):
        known: set[str] = set()
        for block in chain:
            missing = undefined_names(block.code, known)
            if missing:
                fix = (
                    "bind them in the blocks it continues"
                    if block.continues
                    else f"import or define them, or start the block with {MARKER!r} if it "
                    "continues the one before it"
                )
                problems.append(f"{block.where} uses {', '.join(missing)}: {fix}")
            listed = [
                n
                for n in block.names_continued
                if n not in known or n not in used_names(block.code)
            ]
            if listed:
                problems.append(
                    f"{block.where}: its marker names {', '.join(listed)}, which the block "
                    "does not use from the blocks before it"
                )
            known |= bound_names(block.code)
    assert not problems, "\n".join(problems)
    assert _reader_pages()[0].name == "README.md" and len(_reader_pages()) >= 16


def _page(*codes: str) -> list[Block]:
    return [Block("docs/page.md", i, 10 * i, code) for i, code in enumerate(codes, 1)]


def test_blocks_are_grouped_into_chains_by_the_marker():
    blocks = _page(
        "import mpjax\nx = 1\n",
        f"{MARKER}\nprint(x)\n",
        "# Continues the example above (x, y).\nprint(x)\n",
        "import jax\n",  # no marker: a new chain
        "import numpy as np  # Continues the example above.\n",  # not a comment line of its own
    )
    assert [[b.number for b in chain] for chain in chains(blocks)] == [[1, 2, 3], [4], [5]]
    assert [b.continues for b in blocks] == [False, True, True, False, False]
    assert blocks[2].names_continued == ("x", "y") and blocks[1].names_continued == ()
    assert blocks[1].source() == "\n" * 19 + blocks[1].code
    assert chains([]) == []

    with pytest.raises(ValueError, match=r"docs/page.md: block 1 \(line 10\) starts with "):
        chains(_page(f"{MARKER}\nprint(x)\n", "import jax\n"))
    with pytest.raises(ValueError, match="no block comes before it on the page"):
        chains(_page(f"{MARKER}\n"))
    # What a reader would take for the marker, and the test would not: an error, not a chain.
    for near_miss in (
        "# continues the example above.\nprint(x)\n",
        "# Continues the example above\nprint(x)\n",
        "import jax\n# Continues the example above.\n",
    ):
        with pytest.raises(ValueError, match=r"block 2 \(line 20\): .* is not the continuation"):
            chains(_page("x = 1\n", near_miss))


def test_the_names_a_block_uses_and_binds_are_read_statically():
    code = """
import jax, jax.numpy as jnp
from collections import Counter as C
def f(p, *args, k=1, **kw):
    global g
    g = 1
    return p + q + [y for y in r] + jnp.ones(k)
class Net(Base):
    z = 1
    def method(self):
        return z + self  # a class body's names are not a method's
lam = lambda t: t + u
with open("f") as (w1, w2):
    pass
try:
    pass
except ValueError as e:
    print(e)
for i, (j, k) in items:
    pass
match v:
    case {"a": m1, **rest}:
        pass
    case [m2, *ms] if (n := m2):
        print(m1, rest, ms, n)
print(__name__, f, Net, lam, w1, w2, i, j, k, g, C, [s for s in S if s > t2])
"""
    assert undefined_names(code) == ["Base", "S", "items", "q", "r", "t2", "u", "v", "z"]
    assert undefined_names(code, {"Base", "S", "items", "q", "r", "t2", "u", "v"}) == ["z"]
    assert {"jax", "jnp", "C", "f", "g", "Net", "lam", "w1", "e", "m1", "rest", "n"} <= bound_names(
        code
    )
    assert not {"p", "args", "kw", "self", "t", "y"} & bound_names(code)  # local to their scope
    assert {"print", "open", "ValueError"} <= used_names(code)
    assert undefined_names("print(len(x))\nx = 1\n") == []  # order is the runner's business


def test_every_page_is_in_the_site_and_the_slow_list_is_current():
    """A guide the toctree leaves out would not be published; a name in SLOW that is no page
    would hide that a page lost its mark."""
    index = (DOCS / "index.rst").read_text()
    listed = set(re.findall(r"^   ([\w/]+)$", index, re.M))
    for page in DOCS.glob("*.md"):
        assert page.stem in listed, f"docs/{page.name} is in no toctree of docs/index.rst"
    assert set(SLOW) <= {p.name for p in _pages()}, set(SLOW) - {p.name for p in _pages()}
    for page, test in OWN_TESTS.items():
        assert f"docs/{page}" in (ROOT / "tests" / test).read_text(), (page, test)
    assert len(_pages()) >= 15


def test_blocks_that_need_an_extra_are_recognised():
    assert _missing("import jax\nimport mpjax\nmpjax.autocast(f)") is None
    needs = {extra: pattern for pattern, extra, _ in NEEDS}
    cases = {
        "the flax extra": (
            "import flax.linen as nn",
            "from flax import nnx",
            "mpjax.nnx.set_policy(m)",
        ),
        "the equinox extra": ("import equinox as eqx", "mpjax.equinox.apply_policy(m, p)"),
        "the jmp extra": ("import jmp", "policy.to_jmp()"),
        "the test extra": ("import orbax.checkpoint as ocp",),
        "the cuda12 extra (JAX's CUDA plugin)": ('mpjax.plan(f, "h100")(x)', "mpjax.plan(f)(x)"),
        "the tpu extra (libtpu)": ('mpjax.plan(f, "v5p")(x)', 'mpjax.plan_mesh("v5e:2x2")'),
    }
    assert set(cases) == set(needs)
    for extra, codes in cases.items():
        for code in codes:
            assert re.search(needs[extra], code, re.M), code
    assert not re.search(needs["the flax extra"], "import flaxen\nx = mpjax.linear", re.M)
    assert not re.search(needs["the cuda12 extra (JAX's CUDA plugin)"], 'mpjax.plan(f, "v5p")')
    assert _missing("import no_such_package_anywhere") is None  # only the known extras
    assert _module_missing("no_such_package_anywhere.sub")() == (
        "no_such_package_anywhere.sub is not installed"
    )


def _resolve(dotted: str):
    """The object ``mpjax.a.b`` names, importing submodules on the way."""
    obj = importlib.import_module("mpjax")
    for part in dotted.split(".")[1:]:
        if not hasattr(obj, part) and isinstance(obj, types.ModuleType):
            importlib.import_module(f"{obj.__name__}.{part}")
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("name", ["from_pytorch.md", "from_jmp.md"])
def test_the_migration_tables_name_the_api_that_exists(name):
    """Every ``mpjax.`` name the migration pages give as an equivalent exists (the
    integrations' when their extra is installed), and so do the Policy methods and the
    loss-scaling readers' fields they name."""
    text = (DOCS / name).read_text()
    table = "\n".join(line for line in text.splitlines() if line.startswith("| "))
    names = sorted(set(re.findall(r"\bmpjax\.[A-Za-z_][\w.]*[\w]", table)))
    assert len(names) >= 10, names
    for dotted in names:
        if re.match(r"mpjax\.(linen|nnx|equinox)\b", dotted) and _missing(dotted):
            continue
        assert _resolve(dotted) is not None, dotted
    for method in re.findall(r"`policy\.(\w+)\(", table):
        assert callable(getattr(mpjax.Policy, method, None)), method
    for field in re.findall(r"loss_scaling_info\(opt_state\)\.(\w+)|`\.(\w+)`", table):
        assert "".join(field) in mpjax.LossScalingInfo._fields, field


# Runs Sphinx with Flax, Equinox and jmp unimportable (a finder ahead of the others refuses
# them), as in an environment with only the docs extra installed.
_BUILD_WITHOUT_EXTRAS = r"""
import sys

class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("flax", "equinox", "jmp"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None

sys.meta_path.insert(0, Absent())
from sphinx.cmd.build import main

sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_the_docs_build_without_the_extras(tmp_path):
    """With Flax, Equinox and jmp unimportable, the site still builds with warnings as errors
    and every reference resolved (-n): the API pages of mpjax.linen, mpjax.nnx and
    mpjax.equinox are generated against mocks."""
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_parser")
    pytest.importorskip("sphinx_book_theme")
    out = tmp_path / "html"
    result = subprocess.run(
        [sys.executable, "-c", _BUILD_WITHOUT_EXTRAS, "-E", "-n", "-W", "--keep-going", "-q"]
        + ["-b", "html", "-d", str(tmp_path / "doctrees"), str(DOCS), str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env={"PATH": "", "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    for module in ("linen", "nnx", "equinox"):
        html = (out / "api" / f"{module}.html").read_text()
        assert f'id="module-mpjax.{module}"' in html, module
        assert "apply_policy" in html, module


def _inventory_lines(data: bytes) -> list[str]:
    header = data.split(b"\n", 4)
    assert header[0] == b"# Sphinx inventory version 2", header[0]
    return zlib.decompress(header[4]).decode().splitlines()


def test_the_inventories_are_the_ones_make_py_writes():
    """The build links to Python, NumPy, JAX, Flax, optax and Equinox through the inventories
    checked in (CI has no network): each is what docs/inventories/make.py writes, and each
    project of conf.py's intersphinx_mapping has one, pointing at the project's site."""
    make = runpy.run_path(str(DOCS / "inventories" / "make.py"))
    conf = (DOCS / "conf.py").read_text()
    for key, (project, version, entries) in make["PROJECTS"].items():
        written = _inventory_lines(make["inventory"](project, version, entries))
        checked_in = _inventory_lines((DOCS / "inventories" / f"{key}.inv").read_bytes())
        assert checked_in == written, f"docs/inventories/{key}.inv: run docs/inventories/make.py"
        assert f'"{key}": "https://' in conf, key
    assert "jax.Array py:class 1 _autosummary/jax.Array.html#$ -" in _inventory_lines(
        (DOCS / "inventories" / "jax.inv").read_bytes()
    )
