"""The order of a step's collectives, the same on every rank.

Every rank must run its collectives in the same order, while MLX schedules
independent parts of a graph as it sees fit, and the graphs of two ranks
differ where they hold different things (owner buckets, arrays evaluated
earlier on one rank only). A :class:`CollectiveOrder` therefore chains each
collective's input after the previous collective's output.
"""

import atexit
from typing import List, Optional, Sequence

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

    Inside ``mx.compile`` (``traced``) the chain spans the trace: the
    fully sharded modules' gathers and reduce-scatters and the step's
    collectives follow one another, as they do eagerly. The outermost fully
    sharded call of a trace starts its chain (:func:`start_trace`); the
    step joins it only if the chain belongs to its own parameters, so that
    a token from another trace is never used.
    """

    def __init__(self, group=None, traced: bool = False, params: Optional[Sequence] = None):
        # A step starts after the last collective of the group's previous
        # step, so that two steps built before one evaluation (two models, or
        # async_eval of one step while the next is built) stay in order too.
        self._key = None if group is None or traced else id(group)
        self._traced = traced
        self._trace = None
        if traced and group is not None:
            entry = _last_of_trace.get(id(group))
            if entry is not None and (params is None or any(entry.marker is p for p in params)):
                self._trace = entry
        self._last: Optional[mx.array] = self._trace.token if self._trace is not None \
            else _last_of_group.get(self._key)

    @property
    def traced(self) -> bool:
        """Whether the chain is built inside ``mx.compile``."""
        return self._traced

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

    def last(self) -> List[mx.array]:
        """The last collective's output (or token), if any: what to wait for
        besides other arrays before replacing it with :meth:`follow`."""
        return [] if self._last is None else [self._last]

    def follow(self, token: mx.array) -> None:
        """Make the next collective's input wait for ``token`` before anything else it reads."""
        self._last = token

    def after(self, arrays: List[mx.array], eager: bool = False) -> List[mx.array]:
        """Inside ``mx.compile`` (or with ``eager``), ``arrays``, each to be used
        only after the last collective built here (eagerly the chain already
        orders the collectives themselves: unchanged without ``eager``)."""
        if not (self._traced or eager) or self._last is None or not arrays:
            return list(arrays)
        return mx.depends(list(arrays), [empty_of(self._last)])

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
        elif self._trace is not None:
            self._trace.token = empty_of(output)
        return output


class _Trace:
    """The last collective a group's trace built, and a parameter of that trace."""

    def __init__(self, marker: mx.array):
        self.marker: mx.array = marker
        self.token: Optional[mx.array] = None


def start_trace(group, marker: mx.array) -> None:
    """Start the chain of ``group``'s collectives in a new ``mx.compile`` trace.

    Args:
        group (mlx.core.distributed.Group): The group.
        marker (array): A parameter as this trace passes it in (traced): the
            step joins the chain only if it updates that parameter.
    """
    _last_of_trace[id(group)] = _Trace(marker)


def end_trace(group) -> None:
    """Forget ``group``'s chain in the current trace: a traced value must not
    outlive its trace (held at exit, it made MPI ranks exit improperly)."""
    _last_of_trace.pop(id(group), None)


# The last collective each group's steps built (an empty slice of it: the
# dependency, not the data). Keyed by id(group), as the probe cache of
# mlx_fsdp.collectives is.
_last_of_group: dict = {}
# The same inside mx.compile, with the trace it belongs to (_Trace).
_last_of_trace: dict = {}
atexit.register(_last_of_trace.clear)
