"""The order of a step's collectives, the same on every rank.

Every rank must run its collectives in the same order, while MLX schedules
independent parts of a graph as it sees fit, and the graphs of two ranks
differ where they hold different things (owner buckets, arrays evaluated
earlier on one rank only). A :class:`CollectiveOrder` therefore chains each
collective's input after the previous collective's output.
"""

from typing import Optional

import mlx.core as mx

from .layout import empty_of, join


class CollectiveOrder:
    """Keeps a step's collectives in one order on every rank.

    Each collective's input is made to depend on the previous collective's
    output, so it runs only after it, whatever order MLX would otherwise pick
    for independent parts of the graph. Without it, two independent
    all-gathers evaluated in opposite orders on two ranks returned each
    other's data (seen on ring N=2, eager and compiled).

    The dependency also sets the schedule. MLX orders a graph breadth first
    from its outputs (a bounded width at a time) and runs that order
    backwards, so an operation runs as late as its consumers allow, and
    which of two independent inputs is listed first can change which runs
    first. A concatenation that builds a collective's input therefore takes
    the previous output as a part (an empty slice, free): the previous
    collective completes before this one's input buffer is allocated, and
    one bucket's buffers are freed before the next bucket's exist. An input
    that is a view (a lone array) costs nothing to compute early and is
    chained with ``mx.depends``.
    """

    def __init__(self, group=None, traced: bool = False):
        # A step starts after the last collective of the group's previous
        # step, so that two steps built before one evaluation (two models, or
        # async_eval of one step while the next is built) stay in order too.
        # Traced values never cross from one trace (or graph) to another.
        self._key = None if group is None or traced else id(group)
        self._last: Optional[mx.array] = _last_of_group.get(self._key)

    def join(self, parts, dtype) -> mx.array:
        """Concatenate ``parts`` into a collective's input, after the last collective."""
        if self._last is not None and len(parts) > 1:
            parts = [empty_of(self._last)] + list(parts)
        return self.chain(join(parts, dtype))

    def chain(self, x: mx.array) -> mx.array:
        """``x``, to be used only after the last collective (``mx.depends``).

        A concatenation from :meth:`join` already depends on it; this adds
        the dependency where ``x`` is a view or an optimizer's output.
        """
        return x if self._last is None else mx.depends(x, self._last)

    def follow(self, token: mx.array) -> None:
        """Make the next collective's input wait for ``token`` before anything else it reads."""
        self._last = token

    def settle(self, x: mx.array) -> mx.array:
        """``x``, made to evaluate the token kept for the group's next step.

        The token is a lazy slice of the step's last collective output; left
        unevaluated it would keep that whole output (a bucket of parameters)
        alive after the model is gone. Evaluated with ``x``, it holds nothing.
        """
        token = _last_of_group.get(self._key)
        return x if token is None else mx.depends(x, token)

    def ran(self, output: mx.array) -> mx.array:
        """Record ``output`` as the last collective's; return it."""
        self._last = output
        if self._key is not None:
            _last_of_group[self._key] = empty_of(output)
        return output


# The last collective each group's steps built (an empty slice of it: the
# dependency, not the data). Keyed by id(group), as the probe cache of
# mlx_fsdp.collectives is.
_last_of_group: dict = {}
