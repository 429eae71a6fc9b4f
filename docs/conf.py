"""Sphinx configuration of mpjax's API reference, generated from the docstrings.

Build it with warnings as errors, as CI does::

    python -m sphinx -W --keep-going -b html docs docs/_build/html

The reference documents exactly the public surface: the names a module lists in ``__all__``
or, for a module without one, the names the package exports (``mpjax.__all__``). A build fails
when a name of ``mpjax.__all__`` is documented on no page, so a new public name cannot be left
out of the reference.
"""

from __future__ import annotations

import pathlib
import sys

from sphinx.util import logging

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mpjax  # noqa: E402  (the repository root goes on sys.path first)

project = "mpjax"
author = "mpjax authors"
release = version = mpjax.__version__
copyright = "mpjax authors"

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
exclude_patterns = ["_build", "precision_study.md", "**/.ipynb_checkpoints"]
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

html_theme = "alabaster"
html_title = f"mpjax {release}"
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
        if name not in vars(mpjax):  # a deprecated alias a module __getattr__ serves
            continue
        obj = vars(mpjax)[name]
        if isinstance(obj, type(mpjax)):  # a submodule: documented as a module
            if obj.__name__ not in env.domaindata["py"]["modules"]:
                _logger.warning("module %s is on no page of the API reference", obj.__name__)
            continue
        if not any(full.startswith("mpjax.") and full.rsplit(".", 1)[-1] == name
                   for full in documented):
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
    return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"],
                               node["reftarget"], node, contnode)


def setup(app):
    app.connect("autodoc-skip-member", _skip_member)
    app.connect("env-check-consistency", _check_complete)
    app.connect("missing-reference", _resolve_public_alias)
