"""Deprecations: old names kept for one release, each warning with its replacement.

Every deprecated spelling in mpjax warns through :func:`warn_deprecated`, with a
:class:`MpjaxDeprecationWarning`, so a test suite can turn exactly mpjax's deprecations into
errors (``-W error::mpjax.MpjaxDeprecationWarning``) while migrating.
"""

from __future__ import annotations

import warnings


class MpjaxDeprecationWarning(DeprecationWarning):
    """Warned when deprecated mpjax API is used; the message names the replacement."""


def warn_deprecated(old: str, new: str, *, stacklevel: int = 2) -> None:
    """Warns that ``old`` is deprecated in favour of ``new``, attributed to the caller of the
    function that calls this (``stacklevel`` counts from that function, as in ``warnings.warn``).

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warn_deprecated("mpjax.f(x)", "mpjax.g(x)")
    >>> print(caught[0].message)
    mpjax.f(x) is deprecated and will be removed in the next release: use mpjax.g(x).
    """
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release: use {new}.",
        MpjaxDeprecationWarning,
        stacklevel=stacklevel + 1,
    )
