"""Writes the intersphinx inventories the documentation links through (``python make.py``, from
any folder): one ``<project>.inv`` per project of ``docs/conf.py``'s ``intersphinx_mapping``.

The build must not read the network (CI has none), so the inventories are checked in; and they
are written here, from the names the documentation references, rather than downloaded: each
entry is a name with its role and its page on the project's site, in that site's own URL scheme.
A reference to a name not listed fails the build (``-n -W``): add the name here and run this
again. The format is Sphinx's inventory version 2: four header lines, then zlib-compressed
lines of ``name domain:role priority uri display-name``.
"""

from __future__ import annotations

import pathlib
import zlib

HERE = pathlib.Path(__file__).resolve().parent

# The page of each name, relative to the project's site (``docs/conf.py`` holds the sites):
# (name, role, page); the anchor is the name itself, as Sphinx and mkdocstrings write it.
PYTHON = [
    ("collections.Counter", "class", "library/collections.html"),
    ("collections.abc.Callable", "class", "library/collections.abc.html"),
    ("collections.abc.Iterable", "class", "library/collections.abc.html"),
    ("collections.abc.Mapping", "class", "library/collections.abc.html"),
    ("collections.abc.Sequence", "class", "library/collections.abc.html"),
    ("contextlib.AbstractContextManager", "class", "library/contextlib.html"),
    ("os.PathLike", "class", "library/os.html"),
    ("re.Pattern", "class", "library/re.html"),
]
NUMPY = [
    ("numpy.dtype", "class", "reference/generated/numpy.dtype.html"),
    ("numpy.ndarray", "class", "reference/generated/numpy.ndarray.html"),
    ("numpy.float32", "class", "reference/arrays.scalars.html"),
]
# JAX documents each name on a page of its own, named after it.
JAX = [
    ("jax.Array", "class", "_autosummary/jax.Array.html"),
    ("jax.jit", "function", "_autosummary/jax.jit.html"),
    ("jax.sharding.Mesh", "class", "jax.sharding.html"),
]
FLAX = [
    ("flax.linen.Module", "class", "api_reference/flax.linen/module.html"),
    ("flax.linen.intercept_methods", "function", "api_reference/flax.linen/module.html"),
    ("flax.nnx.Module", "class", "api_reference/flax.nnx/module.html"),
    ("flax.nnx.DiffState", "class", "api_reference/flax.nnx/transforms.html"),
    ("flax.nnx.Variable", "class", "api_reference/flax.nnx/variables.html"),
]
OPTAX = [
    ("optax.EmptyState", "class", "api/transformations.html"),
    ("optax.GradientTransformation", "class", "api/transformations.html"),
    ("optax.GradientTransformationExtraArgs", "class", "api/transformations.html"),
    ("optax.OptState", "class", "api/transformations.html"),
]
EQUINOX = [
    ("equinox.Module", "class", "api/module/module/"),
]

PROJECTS = {
    "python": ("Python", "3", PYTHON),
    "numpy": ("NumPy", "stable", NUMPY),
    "jax": ("JAX", "latest", JAX),
    "flax": ("Flax", "latest", FLAX),
    "optax": ("Optax", "latest", OPTAX),
    "equinox": ("Equinox", "latest", EQUINOX),
}


def inventory(project: str, version: str, entries: list[tuple[str, str, str]]) -> bytes:
    """The bytes of an inventory (version 2) of ``entries``."""
    header = (
        "# Sphinx inventory version 2\n"
        f"# Project: {project}\n"
        f"# Version: {version}\n"
        "# The remainder of this file is compressed using zlib.\n"
    )
    body = "".join(f"{name} py:{role} 1 {page}#$ -\n" for name, role, page in sorted(entries))
    return header.encode() + zlib.compress(body.encode(), 9)


def main() -> None:
    for key, (project, version, entries) in PROJECTS.items():
        (HERE / f"{key}.inv").write_bytes(inventory(project, version, entries))


if __name__ == "__main__":
    main()
