"""The state a wrapper keeps, all of it arrays, so that ``mx.compile`` can carry it.

``opt.state`` is one dict for the wrapper's lifetime, updated in place, so
that the usual ``state = [model.state, opt.state]`` works as the inputs and
outputs of a compiled step. Every key exists from the start:

* ``optimizer``: the wrapped optimizer's own state (the same dict object).
  Under ``fsdp_step`` it holds, per sub-optimizer, this rank's state of each
  flat bucket (``state["b3"]["m"]``: the bucket's shard) and of each whole
  array this rank owns (``state["layers.0.weight"]``); see :mod:`mlx_fsdp.plan`.
* ``master``: master copies in ``master_dtype`` of lower-precision
  parameters, keyed like the optimizer state (bucket keys and owned paths
  under ``fsdp_step``, parameter paths under ``ddp_step``).
* ``accumulated``: the sum of the micro-batch gradients of the current
  optimizer step: whole gradients by path (local accumulation) or reduced
  shards by bucket key (sharded accumulation, and any accumulation inside
  ``mx.compile``).
* ``micro_step``: micro-batches accumulated since the last optimizer step.
* ``grad_norm``: the global gradient norm before clipping of the last step
  (NaN until a step with ``max_norm`` has run).
"""

from typing import TypedDict

import mlx.core as mx


class WrapperState(TypedDict):
    """The keys of ``opt.state`` (see the module docstring)."""

    optimizer: dict
    master: dict
    accumulated: dict
    micro_step: mx.array
    grad_norm: mx.array


def new_state(optimizer_state: dict) -> WrapperState:
    """A fresh state around the wrapped optimizer's state dict."""
    return WrapperState(
        optimizer=optimizer_state,
        master={},
        accumulated={},
        micro_step=mx.array(0, mx.int32),
        grad_norm=mx.array(float("nan"), mx.float32),
    )


def replace(state: WrapperState, new: dict):
    """Replace the contents of ``state`` in place by those of ``new`` (a saved state).

    Missing keys get their fresh values, so a state saved before a key
    existed still loads.

    Raises:
        ValueError: If ``new`` is not a dict with an ``optimizer`` entry.
    """
    if not isinstance(new, dict) or "optimizer" not in new:
        raise ValueError(
            "The state must be a dict with an 'optimizer' entry, as this wrapper's "
            ".state returns it."
        )
    fresh = new_state(new["optimizer"])
    state.clear()
    state.update(fresh)
    state.update({k: v for k, v in new.items() if k in fresh})


def tree_changed(was: tuple, now: tuple, detail: str, fix: str) -> ValueError:
    """The error of a gradient tree that the optimizer state, built for another one, cannot follow.

    Args:
        was (tuple): ``(arrays, elements)`` the state was built for.
        now (tuple): ``(arrays, elements)`` of this step's gradients.
        detail (str): What changed, e.g. ``": 'l2.weight' has no state"``.
        fix (str): What to do instead.
    """
    return ValueError(
        f"The gradient tree changed since the optimizer state was built: it was for {was[0]} "
        f"arrays ({was[1]} elements), now there are {now[0]} ({now[1]}){detail}. The "
        f"optimizer state cannot follow; {fix}")
