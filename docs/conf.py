"""Sphinx configuration of mpjax's documentation: the guides (Markdown, through MyST) and the
API reference, generated from the docstrings.

Build it with warnings as errors, as CI does (``pip install -e ".[docs]"`` first)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html

It builds with or without the optional extras installed: a missing Flax, Equinox or jmp is
replaced by stand-ins (see ``_StandIn``) when autodoc imports the modules that need it, so the
pages of :mod:`mpjax.linen`, :mod:`mpjax.nnx` and :mod:`mpjax.equinox` are generated either
way.

The reference documents exactly the public surface: the names a module lists in ``__all__``
or, for a module without one, the names the package exports (``mpjax.__all__``). A build fails
when a name of ``mpjax.__all__`` is documented on no page, so a new public name cannot be left
out of the reference.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import pathlib
import sys
import types

from sphinx.util import logging

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mpjax  # noqa: E402  (the repository root goes on sys.path first)

project = "mpjax"
author = "mpjax authors"
release = version = mpjax.__version__
copyright = "mpjax authors"

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "**/.ipynb_checkpoints"]
# No intersphinx: CI may have no network, and the build must not depend on it.

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


def _resolve_public_alias(app, env, node, contnode):
    """Resolve ``:func:`mpjax.get_policy``` to where the name is documented."""
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    prefix, _, name = target.rpartition(".")
    if prefix != "mpjax" or name not in vars(mpjax):
        return None
    obj = vars(mpjax)[name]
    home = getattr(obj, "__module__", None)
    if not home or home == "mpjax":
        return None
    node["reftarget"] = f"{home}.{name}"
    domain = env.get_domain("py")
    return domain.resolve_xref(
        env, node["refdoc"], app.builder, node["reftype"], node["reftarget"], node, contnode
    )


def setup(app):
    app.connect("autodoc-skip-member", _skip_member)
    app.connect("env-check-consistency", _check_complete)
    app.connect("missing-reference", _resolve_public_alias)
