"""The state delayed fp8 scaling threads through one run of the casting engine, by matmul site.

Under a policy whose fp8 recipe scales with ``"delayed"`` scaling, every matmul the engine runs in
fp8 is a *site* with its own :class:`mpjax.fp8.Fp8Meta` (scales and amax history). A site is named
by where it runs and its count there, inside the scans around it; a run either discovers the
sites (and so the initial state) or reads each site's state from a given mapping.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable, Mapping
from typing import Any

from mpjax import fp8

__all__ = ["DelayedScaling"]


class DelayedScaling:
    """The delayed fp8 scaling state that one engine run threads through its matmuls.

    Each matmul that a delayed-scaling policy runs in fp8 is a *site*, named by where it runs
    (the path of its module's region, else its scope path) and its count there
    (``"Dense_0#0"``), inside the scans around it (``"h[scan0]/mlp/fc#0"``, its state stacked
    along the scan's length). ``metas`` maps
    the sites of the current level to their :class:`mpjax.fp8.Fp8Meta`; None while
    discovering, when ``found`` collects each site's history length and stacking shape.
    """

    def __init__(self, metas: Mapping[str, fp8.Fp8Meta] | None):
        self.metas = metas
        self.found: dict[str, tuple[int, tuple[int, ...]]] = {}
        self.namespace = ""
        self.shape: tuple[int, ...] = ()
        self.counts: collections.Counter = collections.Counter()
        self.opaque: str | None = None  # the enclosing primitive that hides the state

    def _next(self, base: str) -> int:
        n = self.counts[base]
        self.counts[base] += 1
        return n

    def site(self, where: str) -> str:
        base = self.namespace + where
        return f"{base}#{self._next(base)}"

    def scan_namespace(self, where: str) -> str:
        base = self.namespace + where
        return f"{base}[scan{self._next(base + '[scan]')}]/"

    @contextlib.contextmanager
    def level(self, namespace: str, metas: Mapping[str, Any] | None, length: int):
        """Inside a scan: the sites of its body, each iteration's slice of their state (or,
        discovering, their state stacked ``length`` deep)."""
        saved = (self.namespace, self.metas, self.shape, self.counts)
        self.namespace, self.metas, self.counts = namespace, metas, collections.Counter()
        if metas is None:
            self.shape = (*self.shape, length)
        try:
            yield
        finally:
            self.namespace, self.metas, self.shape, self.counts = saved

    @contextlib.contextmanager
    def hidden(self, primitive: str):
        saved, self.opaque = self.opaque, self.opaque or primitive
        try:
            yield
        finally:
            self.opaque = saved

    def dot(
        self,
        where: str,
        recipe: fp8.Fp8Recipe,
        current: Callable[..., Any],
        dimension_numbers: Any,
        precision: Any,
    ) -> Callable[..., Any]:
        """The fp8 matmul of the next site at ``where``: with delayed scaling from the site's
        state, or ``current`` (current scaling) while discovering the sites.

        Raises:
          ValueError: if the state has no :class:`mpjax.fp8.Fp8Meta` of the right shapes for
            the site.
        """
        site = self.site(where)
        if self.metas is None:  # discovering: the function is only traced
            self.found[site] = (recipe.history, self.shape)
            return current
        meta = self.metas.get(site)
        meta = None if meta is None else fp8.as_meta(meta)
        expected = ((*self.shape, 3), (*self.shape, recipe.history, 3))
        if meta is None or (meta.scale.shape, meta.amax_history.shape) != expected:
            found = (
                "no state"
                if meta is None
                else f"state of shapes {(meta.scale.shape, meta.amax_history.shape)}"
            )
            raise ValueError(
                f"The fp8 state has {found} for the matmul {site!r}, which needs an Fp8Meta of "
                f"shapes {expected} (scale, amax_history; history {recipe.history}). Make the "
                "state for this model and policy: it lists the matmuls it was made for."
            )
        return functools.partial(
            fp8.delayed_dot_general,
            dimension_numbers=dimension_numbers,
            meta=meta,
            margin=recipe.margin,
            precision=precision,
        )

    def initial_state(self) -> dict[str, fp8.Fp8Meta]:
        return {
            site: fp8.init_meta(history, shape) for site, (history, shape) in self.found.items()
        }
