"""Sphinx configuration of mpjax's documentation: the guides (Markdown, through MyST) and the
API reference, generated from the docstrings.

Build it with warnings as errors and every reference resolved, as CI does (``pip install -e ".[docs]"`` first)::

    python -m sphinx -n -W --keep-going -b html docs docs/_build/html

It builds with or without the optional extras installed: a missing Flax, Equinox or jmp is
replaced by stand-ins (see ``_StandIn``) when autodoc imports the modules that need it, so the
pages of :mod:`mpjax.linen`, :mod:`mpjax.nnx` and :mod:`mpjax.equinox` are generated either
way.

The reference documents exactly the public surface: the names a module lists in ``__all__``
or, for a module without one, the names the package exports (``mpjax.__all__``). A build fails
when a name of ``mpjax.__all__`` is documented on no page, so a new public name cannot be left
out of the reference. The pages name modules with ``.. mpjax-module:: mpjax.policy`` (see
``PublicModule``): a module's docstring, then each of its public names, documented where users
import it: ``mpjax.Policy`` for a name the package exports, ``mpjax.policy.X`` for one it does
not, so moving a module changes its page's list and no reference.

References to Python, NumPy, JAX, Flax, optax and Equinox resolve through intersphinx, from
inventories checked in under ``docs/inventories/`` (written by ``docs/inventories/make.py``):
the build reads no network. Build with ``-n -W``: a reference that resolves nowhere fails.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import inspect
import pathlib
import re
import sys
import types

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.ext import intersphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mpjax  # noqa: E402  (the repository root goes on sys.path first)

project = "mpjax"
author = "mpjax authors"
release = version = mpjax.__version__
copyright = "mpjax authors"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx.ext.intersphinx",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "**/.ipynb_checkpoints", "inventories"]

# Links to the projects' own sites, resolved from inventories checked in: CI has no network,
# and the build must not depend on it. docs/inventories/make.py writes them.
INVENTORIES = ROOT / "docs" / "inventories"
intersphinx_mapping = {
    project_name: (url, str(INVENTORIES / f"{project_name}.inv"))
    for project_name, url in {
        "python": "https://docs.python.org/3/",
        "numpy": "https://numpy.org/doc/stable/",
        "jax": "https://docs.jax.dev/en/latest/",
        "flax": "https://flax.readthedocs.io/en/latest/",
        "optax": "https://optax.readthedocs.io/en/latest/",
        "equinox": "https://docs.kidger.site/equinox/",
    }.items()
}
nitpicky = True
# Type variables and private base classes that signatures name: not documented, not linked.
nitpick_ignore_regex = [("py:class", r"mpjax\.policy\.T"), ("py:class", r"mpjax\..*\._\w+")]

napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_attr_annotations = True
# "Attributes:" as fields of the class, not as entries that clash with NamedTuple fields.
napoleon_use_ivar = True

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autodoc_default_options = {"members": True, "show-inheritance": True}
# The optional extras that are not installed are replaced by stand-ins, so that the API pages of
# the modules that need them build without them. Sphinx's own ``autodoc_mock_imports`` gives
# instances where those modules need classes at import time (they register Flax's and
# Equinox's norm classes as rules, subclass ``nn.Module`` and ``eqx.Module``), so the stand-ins
# are made here: every name of a missing package is a class, its attributes classes again;
# called with one function or class, it returns it (a decorator), and subscripted, itself.
OPTIONAL_EXTRAS = ("flax", "equinox", "jmp")


class _StandIn(type):
    """The metaclass of a missing package's names."""

    def __getattr__(cls, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _StandIn(
            name, (), {"__module__": cls.__module__, "__qualname__": f"{cls.__qualname__}.{name}"}
        )

    def __getitem__(cls, item):
        return cls

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return cls

    def __or__(cls, other):
        return cls

    __ror__ = __or__


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _StandIn(name, (), {"__module__": self.__name__, "__qualname__": name})


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of the missing packages (``flax``, ``flax.linen``, ...) give stand-in modules."""

    def __init__(self, packages: list[str]):
        self.packages = packages

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.packages:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StandInModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def _missing(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return True
    return False


# Decided after ``import mpjax`` above, which therefore saw the real environment.
MISSING_EXTRAS = [name for name in OPTIONAL_EXTRAS if _missing(name)]
if MISSING_EXTRAS:
    sys.meta_path.insert(0, _StandInFinder(MISSING_EXTRAS))

# MyST: anchors for the headings of the guides down to ###, so a guide can link to a section
# (``[loss scaling](loss_scaling.md#the-order-of-a-step)``); ```python fences are highlighted.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

html_theme = "sphinx_book_theme"
html_title = f"mpjax {release}"
html_theme_options = {"show_toc_level": 2, "navigation_with_keys": False}
html_static_path: list[str] = []

_logger = logging.getLogger("mpjax.docs")


def _public(name: str, obj: object) -> bool:
    """Whether a module member belongs to the public surface (see the module docstring).

    Autodoc already limits a module with ``__all__`` to those names; for a module without one
    it takes every name defined there, helpers included, and this keeps the exported ones.
    """
    home = sys.modules.get(getattr(obj, "__module__", None) or "")
    if name in getattr(home, "__all__", ()):
        return True
    return name in mpjax.__all__ and vars(mpjax).get(name) is obj


def _skip_member(app, what, name, obj, skip, options):
    if what == "module":
        return not _public(name, obj)  # public constants too, with or without a doc comment
    return None  # autodoc's own rules (no private names, no undocumented class members)


def _check_complete(app, env):
    """Warn (an error under ``-W``) for every name of ``mpjax.__all__`` on no page."""
    documented = set(env.domaindata["py"]["objects"])
    for name in mpjax.__all__:
        if name not in vars(mpjax):  # an integration the package's __getattr__ serves
            continue
        obj = vars(mpjax)[name]
        if isinstance(obj, type(mpjax)):  # a submodule: documented as a module
            if obj.__name__ not in env.domaindata["py"]["modules"]:
                _logger.warning("module %s is on no page of the API reference", obj.__name__)
            continue
        if not any(
            full.startswith("mpjax.") and full.rsplit(".", 1)[-1] == name for full in documented
        ):
            _logger.warning("mpjax.%s is on no page of the API reference (docs/api/*.rst)", name)


# Classes that annotations name by a private home, linked at their public name.
ALIASES = {
    "optax._src.base.GradientTransformation": "optax.GradientTransformation",
    "optax._src.base.GradientTransformationExtraArgs": "optax.GradientTransformationExtraArgs",
    "equinox._module._module.Module": "equinox.Module",
    "equinox._module.Module": "equinox.Module",  # Equinox before 0.13
    "jax._src.mesh.Mesh": "jax.sharding.Mesh",
    "flax.nnx.transforms.autodiff.DiffState": "flax.nnx.DiffState",
    "flax.nnx.module.Module": "flax.nnx.Module",
    "flax.nnx.variablelib.Variable": "flax.nnx.Variable",
    "nn.Module": "flax.linen.Module",
    "nnx.Module": "flax.nnx.Module",
}


def _candidates(target: str) -> list[str]:
    """Where ``target`` may be documented: at its public name (``mpjax.policy.Policy`` is
    ``mpjax.Policy``, ``optax._src.base.GradientTransformation`` ``optax.GradientTransformation``)
    or, for a name the package exports but the reference documents in its module (a constant),
    there."""
    if target in ALIASES:
        return [ALIASES[target]]
    parts = target.split(".")
    found = []
    if parts[0] in vars(mpjax) and not isinstance(vars(mpjax)[parts[0]], types.ModuleType):
        parts = ["mpjax", *parts]  # get_policy, named in a module that does not define it
        found.append(".".join(parts))
    if parts[0] != "mpjax":  # Bounds, named in a docstring away from its module
        for module in [m for n, m in sys.modules.items() if n.startswith("mpjax.") and m]:
            obj = vars(module).get(parts[0])
            if obj is not None and getattr(obj, "__module__", module.__name__) == module.__name__:
                found.append(f"{module.__name__}.{target}")
        return found
    if len(parts) < 2:
        return found
    for i in range(2, len(parts)):  # mpjax.<module path>.Name[.attribute]
        module = sys.modules.get(".".join(parts[:i]))
        name = parts[i]
        if (
            module is not None
            and name in vars(mpjax)
            and getattr(module, name, None) is vars(mpjax).get(name)
        ):
            found.append(".".join(["mpjax", *parts[i:]]))
    obj = vars(mpjax).get(parts[1])
    home = getattr(obj, "__module__", None)
    if home and home != "mpjax" and not isinstance(obj, types.ModuleType):
        found.append(".".join([home, *parts[1:]]))
    return found


def _resolve_public_alias(app, env, node, contnode):
    """Resolve a reference by another name of its target (see ``_candidates``)."""
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    domain = env.get_domain("py")
    for candidate in _candidates(target):
        node["reftarget"] = candidate
        found = domain.resolve_xref(
            env, node["refdoc"], app.builder, node["reftype"], candidate, node, contnode
        ) or intersphinx.missing_reference(app, env, node, contnode)
        if found is not None:
            return found
    node["reftarget"] = target
    return None


def _public_names(module: types.ModuleType) -> list[str]:
    """A module's public names: its ``__all__``, or the names the package exports from it."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    source = inspect.getsource(module)
    names = []
    for name in mpjax.__all__:
        obj = vars(mpjax).get(name)
        if getattr(module, name, None) is not obj:
            continue
        if isinstance(obj, type) or inspect.isfunction(obj):
            if obj.__module__ == module.__name__:
                names.append(name)
        elif re.search(rf"^{name}\b\s*[:=]", source, re.M):  # a constant defined there
            names.append(name)
    return names


def _directive(obj: object) -> str:
    if isinstance(obj, type):
        return "autoexception" if issubclass(obj, BaseException) else "autoclass"
    return "autofunction" if callable(obj) else "autodata"


class PublicModule(SphinxDirective):
    """``.. mpjax-module:: mpjax.policy``: the module's docstring, then each of its public names
    where users import it. A class or function the package exports is documented as
    ``mpjax.Name``, the rest as ``mpjax.policy.Name``; constants stay in their module, whose
    source holds their doc comments."""

    required_arguments = 1
    # ``:also: Name, Other``: names the public ones refer to (the types of their arguments),
    # documented with them though the module does not list them.
    option_spec = {"also": lambda text: [n.strip() for n in text.split(",") if n.strip()]}

    def run(self) -> list[nodes.Node]:
        name = self.arguments[0]
        module = importlib.import_module(name)
        at_top, in_module = [], []
        for member in _public_names(module) + self.options.get("also", []):
            obj = getattr(module, member)
            exported = (
                vars(mpjax).get(member) is obj
                and _directive(obj) != "autodata"
                and member != name.rsplit(".", 1)[-1]  # mpjax.autocast is the module's name
            )
            (at_top if exported else in_module).append((member, obj))
        lines = [f".. automodule:: {name}", "   :no-members:", ""]
        for where, members in (("mpjax", at_top), (name, in_module)):
            if members:
                lines += [f".. currentmodule:: {where}", ""]
                lines += [f".. {_directive(obj)}:: {member}\n" for member, obj in members]
        node = nodes.section()
        node.document = self.state.document
        self.state.nested_parse(StringList(lines, source=name), self.content_offset, node)
        return node.children


def setup(app):
    app.add_directive("mpjax-module", PublicModule)
    app.connect("autodoc-skip-member", _skip_member)
    app.connect("env-check-consistency", _check_complete)
    app.connect("missing-reference", _resolve_public_alias)
