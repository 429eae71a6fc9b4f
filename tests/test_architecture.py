"""The package's architecture: imports flow one way through the layers, with no cycle and no
import hidden in a function, and the core works with Flax unavailable."""

import ast
import functools
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mpjax"

# The rooms of the package, lowest first: the core vocabulary at the top level, then each
# subpackage or top-level module that builds on it. A room may import its own modules and those
# of lower rooms, never a higher room's. Every top-level entry of mpjax/ is a room.
ROOMS = (
    "jax_compat",  # every reader of JAX internals and every difference between versions
    "fp8",  # the fp8 numerics a policy's recipe names
    "block_scaled",  # the block formats (MXFP8, NVFP4) a recipe names
    "grouped",  # a mixture of experts' grouped GEMMs: kernels chosen per GPU, fp8 scales
    "policy",
    "rules",
    "table",  # the text tables every report renders
    "optim",  # the optimizer side: loss scaling, master weights, state precision, memory
    "casting",  # the casting engine: regions, op categories, the trace context, fp8 sites
    "autocast",  # the public transform on the engine
    "attention",  # an operation that asks the engine for its region's compute dtype
    "experts",  # mixture-of-experts operations (ragged_dot), grouped under a policy or not
    "inspection",  # describe and the reports of a traced function
    "planning",  # plans of a compiled function: GPU and TPU targets, their HLO, collectives
    "doctor",  # the precision doctor and the monitor
    "linen",  # the integrations
    "nnx",
    "equinox",
    "flax_serialization",
    "__init__",
)
ROOM = {room: i for i, room in enumerate(ROOMS)}
SUBPACKAGES = tuple(room for room in ROOMS if (PACKAGE / room).is_dir())

# Lowest first, within the rooms. A module may import modules of its own layer or of lower
# ones, never of a higher one. Every module of the package must have a layer.
LAYERS = (
    # The compat package: its private modules, and its __init__ that re-exports them.
    {"jax_compat", "jax_compat._jaxprs", "jax_compat._lowering", "jax_compat._devices"},
    {"fp8", "block_scaled"},  # the narrow matmuls: per-tensor and rowwise fp8, block formats
    {"grouped.kernels"},  # mpjax's Mosaic GPU kernels for grouped GEMMs JAX has none for
    {"grouped.blackwell"},  # mpjax's Blackwell kernel for the experts' weight gradient
    {"grouped.matmul"},  # grouped GEMMs (mixture of experts), kernels chosen per target
    {"grouped.fp8"},  # grouped GEMMs in fp8: the recipes' scales around them
    {"grouped.capacity"},  # block-scaled experts as batched GEMMs over each expert's slots
    {"policy"},
    {"rules"},
    # The casting engine's parts, the inspection of jaxprs, and the optimizer side.
    {
        "casting.regions",
        "casting.op_categories",
        "table",
        "inspection.matmuls",
        "planning.hlo_text",
        "planning.targets",
        "planning.rows",
        "planning.grouped",  # the grouped GEMMs a plan reads: kernels, dense expansions
        "planning.traffic",  # the bytes a GPU step's fusions that are no matmul move
        "planning.collectives",
        "planning.deviceless",  # compile-only GPUs and TPUs, and their compiles
        "planning.compile_only",  # tracing for devices this process lacks (AOT compiles)
        "planning.loops",  # the estimate of a step's loops, each body its trips times
        "planning.arguments",  # the arguments a plan compiles, on the target's devices
        "planning.devices",  # a target's compile-only devices, or why there are none
        "planning.plan",
        "planning.matmul_gains",  # which GEMMs a narrow recipe speeds up, by the roofline
        "optim.gradient_checks",
        "optim.loss_scale",
        "optim.loss_scaling",
        "optim.loss_scaling_readers",
        "optim.master_weights",
        "optim.rounding",
        "optim.quantization",  # blockwise 8- and 4-bit codes: the formats, maps and layout
        "doctor.range_stats",
        "casting.fp8_sites",  # the delayed fp8 scaling state of an engine run, by matmul site
        "casting.gradient_reduction",  # the ops the engine binds for the policy's reduce dtype
        "casting.custom_rules",  # the user's custom derivative rules, traced for the engine
        "casting.collectives",  # lax collectives in a policy's dtypes, for code in shard_map
    },
    # Optimizer transformations that read the loss-scaling state, and the memory report
    # that names their parts.
    {
        "optim.state_precision",
        "optim.quantized_state",
        "optim.low_precision_params",
        "optim.memory",
    },
    {"casting.trace_context"},  # what the engine is tracing now, and what traced code may ask
    {"casting.engine"},  # the casting engine: every integration, autocast and the reports use it
    {"autocast", "inspection.report", "doctor.monitor"},
    {"attention", "experts"},  # operations that ask the engine what it is tracing
    {"inspection.describe"},  # the one report entry point: the integrations register with it
    # The precision doctor's parts: the side-by-side evaluation of a jaxpr under a policy and
    # in f32, and the report it fills.
    {"doctor.side_by_side", "doctor.diagnosis_report"},
    {"doctor.recommendations", "doctor.layer_stack"},  # rules from the measures, or the stack
    {"doctor.diagnosis"},  # runs what describe takes, side by side under a policy and in f32
    {"linen", "nnx", "flax_serialization", "equinox"},  # the Flax and Equinox integrations
    {"grouped", "casting", "optim", "inspection", "planning", "doctor"},  # docstring-only __init__s
    {"__init__"},
)
LAYER = {module: i for i, layer in enumerate(LAYERS) for module in layer}

# Modules that must import without Flax, and run: everything below the integrations.
FLAX_FREE = (
    "fp8",
    "grouped.kernels",
    "grouped.blackwell",
    "grouped.matmul",
    "grouped.fp8",
    "grouped.capacity",
    "policy",
    "casting.collectives",
    "casting.gradient_reduction",
    "casting.custom_rules",
    "rules",
    "casting.regions",
    "casting.op_categories",
    "jax_compat",
    "table",
    "inspection.matmuls",
    "attention",
    "experts",
    "casting.trace_context",
    "casting.fp8_sites",
    "casting.engine",
    "autocast",
    "inspection.report",
    "inspection.describe",
    "doctor.range_stats",
    "doctor.side_by_side",
    "doctor.diagnosis_report",
    "doctor.recommendations",
    "doctor.layer_stack",
    "doctor.diagnosis",
    "doctor.monitor",
)
# The optimizer side, which must not need Flax either.
OPTIMIZER_SIDE = tuple(
    f"optim.{path.stem}"
    for path in sorted((PACKAGE / "optim").glob("*.py"))
    if path.stem != "__init__"
)


@functools.cache
def _modules() -> dict[str, pathlib.Path]:
    """Every module of the package by its name under mpjax: ``"policy"``,
    ``"casting.engine"``; a subpackage's ``__init__`` by the subpackage's name, the package's
    own as ``"__init__"``."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts == ("__init__",):
            modules["__init__"] = path
        else:
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _room(module: str) -> str:
    return module.split(".")[0]


def _mpjax_module(name: str) -> str | None:
    """The module of the package that the dotted ``name`` names or lies in: ``"rules"`` for
    ``"mpjax.rules"`` or ``"mpjax.rules.Rules"``, ``"casting.engine"`` for
    ``"mpjax.casting.engine.run_in_regions"``, ``"casting"`` for ``"mpjax.casting"``,
    ``"__init__"`` for ``"mpjax"``, None for another package."""
    parts = name.split(".")
    if parts[0] != "mpjax":
        return None
    modules = _modules()
    for length in range(len(parts) - 1, 0, -1):
        candidate = ".".join(parts[1 : length + 1])
        if candidate in modules:
            return candidate
    return "__init__"


def _imports(node: ast.AST) -> list[tuple[str, ast.AST]]:
    """``(imported mpjax module, import node)`` for each import statement under ``node``."""
    found = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Import):
            found += [(_mpjax_module(alias.name), sub) for alias in sub.names]
        elif isinstance(sub, ast.ImportFrom):
            assert sub.level == 0, "mpjax uses absolute imports"
            base = sub.module or ""
            # `from mpjax.casting import regions` imports a module; `from mpjax.rules import
            # Rules` a name: a name that is a module of the package counts as that module.
            found += [
                (
                    _mpjax_module(f"{base}.{alias.name}")
                    if base.split(".")[0] == "mpjax"
                    and f"{base}.{alias.name}".removeprefix("mpjax.") in _modules()
                    else _mpjax_module(base),
                    sub,
                )
                for alias in sub.names
            ]
    return [(module, sub) for module, sub in found if module is not None]


def _functions(tree: ast.Module) -> list[ast.AST]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
    ]


def _graph() -> dict[str, set[str]]:
    """Module -> the mpjax modules it imports, at module level or in a function."""
    graph = {}
    for module, path in _modules().items():
        tree = ast.parse(path.read_text(), str(path))
        graph[module] = {imported for imported, _ in _imports(tree)} - {module}
    return graph


def _flax_imports(module: str) -> list[str]:
    tree = ast.parse(_modules()[module].read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    return [name for name in names if name.split(".")[0] == "flax"]


def _needs(module: str, graph: dict[str, set[str]]) -> set[str]:
    """``module`` and every mpjax module it imports, directly or not (``__init__`` aside:
    importing a submodule runs the package's ``__init__`` whatever it is)."""
    seen, todo = set(), [module]
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.add(current)
            todo += graph[current] - {"__init__"}
    return seen


def test_every_module_has_a_layer():
    modules = set(_modules())
    assert modules - set(LAYER) == set(), "give each new module a layer in LAYERS"
    assert set(LAYER) - modules == set(), "LAYERS names modules that no longer exist"


# No module has more lines than this, so that each stays one concept a reader can hold.
MAX_MODULE_LINES = 800


def test_no_module_is_longer_than_the_limit():
    lengths = {module: len(path.read_text().splitlines()) for module, path in _modules().items()}
    assert len(lengths) > 10  # the package was found
    assert {name: n for name, n in lengths.items() if n > MAX_MODULE_LINES} == {}


def test_imports_flow_down_the_layers():
    upward = [
        f"{module} (layer {LAYER[module]}) imports {imported} (layer {LAYER[imported]})"
        for module, imports in _graph().items()
        for imported in sorted(imports)
        if LAYER[imported] > LAYER[module]
    ]
    assert upward == []


def test_the_top_level_shows_the_rooms():
    # `ls mpjax` shows the architecture: the core vocabulary, the public modules and one
    # subpackage per larger concept, each a room in ROOMS; nothing else lies there.
    entries = {path.stem if path.suffix == ".py" else path.name for path in PACKAGE.iterdir()}
    entries -= {"__pycache__", "py.typed"}
    assert entries == set(ROOMS)
    assert len(entries) <= 20


def test_no_room_imports_a_room_above_it():
    upward = [
        f"{module} ({_room(module)}) imports {imported} ({_room(imported)})"
        for module, imports in _graph().items()
        for imported in sorted(imports)
        if ROOM[_room(imported)] > ROOM[_room(module)]
    ]
    assert upward == []


@pytest.mark.parametrize(
    "subpackage", ["grouped", "casting", "optim", "inspection", "planning", "doctor"]
)
def test_each_subpackage_says_what_it_holds(subpackage):
    # Its __init__ is a docstring naming each module it holds, and imports nothing (importing
    # one module of it must not import the others).
    assert subpackage in SUBPACKAGES
    init = PACKAGE / subpackage / "__init__.py"
    tree = ast.parse(init.read_text())
    docstring = ast.get_docstring(tree)
    assert docstring and len(tree.body) == 1
    held = {p.stem for p in (PACKAGE / subpackage).glob("*.py")} - {"__init__"}
    assert held and {m for m in held if f"mpjax.{subpackage}.{m}" not in docstring} == set()


def test_the_import_graph_has_no_cycle():
    graph = _graph()
    state: dict[str, str] = {}
    cycles = []

    def visit(module, stack):
        state[module] = "open"
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                cycles.append(" -> ".join(stack[stack.index(imported) :] + [imported]))
            elif imported not in state:
                visit(imported, stack + [imported])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_no_function_imports_an_mpjax_module():
    found = []
    for path in _modules().values():
        tree = ast.parse(path.read_text())
        for function in _functions(tree):
            found += [
                f"{path.relative_to(PACKAGE)}:{node.lineno} imports mpjax.{module} inside a function"
                for module, node in _imports(function)
            ]
    assert found == []


def test_the_checker_sees_imports_in_functions_and_upward_imports():
    # The checks above pass on the package; here they must catch what they look for.
    tree = ast.parse(
        textwrap.dedent("""
        from mpjax.policy import Policy
        def f():
            from mpjax import linen
            import mpjax.inspection.describe as d
    """)
    )
    (function,) = _functions(tree)
    assert [m for m, _ in _imports(tree)] == ["policy", "linen", "inspection.describe"]
    assert [m for m, _ in _imports(function)] == ["linen", "inspection.describe"]
    assert _mpjax_module("mpjax.casting.engine.Interpreter") == "casting.engine"
    from_package = ast.parse("from mpjax.casting import regions\nfrom mpjax import policy")
    assert [m for m, _ in _imports(from_package)] == ["casting.regions", "policy"]
    assert _mpjax_module("mpjax") == "__init__" and _mpjax_module("flax.linen") is None


@pytest.mark.parametrize("module", FLAX_FREE)
def test_the_core_imports_no_flax(module):
    graph = _graph()
    assert {m: _flax_imports(m) for m in _needs(module, graph) if _flax_imports(m)} == {}


@pytest.mark.parametrize("module", OPTIMIZER_SIDE)
def test_the_optimizer_side_imports_no_flax(module):
    graph = _graph()
    assert {m: _flax_imports(m) for m in _needs(module, graph) if _flax_imports(m)} == {}


def _run_without_flax(code: str) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh Python in which ``import flax`` fails."""
    prelude = "import sys\nsys.modules['flax'] = None  # `import flax` raises ImportError\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


CORE_WITHOUT_FLAX = """
    import jax, jax.numpy as jnp
    {setup}
    policy = get_policy("mixed_bfloat16")
    assert policy.compute_dtype == jnp.bfloat16
    assert Rules({{"head": "float32"}}, default=policy).resolve("head", object).policy == (
        get_policy("float32"))
    w, x = jnp.ones((3, 3)), jnp.ones((2, 3))
    f = autocast(lambda w, x: jnp.tanh(x @ w), policy)
    assert f(w, x).dtype == jnp.float32
    assert [m.operand_dtypes for m in inspect_matmuls(f)(w, x)] == [(jnp.bfloat16,) * 2]
    for name in ("linen", "nnx"):
        try:
            {import_integration}
        except ImportError as error:
            assert 'pip install "mpjax[flax]"' in str(error), error
        else:
            raise AssertionError(f"mpjax.{{name}} imported without Flax")
    print("ok")
"""


def test_the_core_modules_import_and_run_without_flax():
    # The package's __init__ is bypassed (an empty package object), so that what is checked is
    # the core modules themselves: the whole package is checked by the test below.
    setup = f"""
    import importlib, types
    package = types.ModuleType("mpjax")
    package.__path__ = [{str(PACKAGE)!r}]
    sys.modules["mpjax"] = package
    for module in {FLAX_FREE!r}:
        importlib.import_module("mpjax." + module)
    from mpjax.policy import get_policy
    from mpjax.rules import Rules
    from mpjax.autocast import autocast
    from mpjax.inspection.matmuls import inspect_matmuls
    """
    code = CORE_WITHOUT_FLAX.format(
        setup=textwrap.indent(textwrap.dedent(setup), "    ").strip(),
        import_integration='importlib.import_module("mpjax." + name)',
    )
    result = _run_without_flax(code)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


# `import mpjax` as a whole with Flax blocked, loss scaling included: tests/test_without_flax.py.
