"""Which optimizers give the same result on a flat shard as on the whole array.

An element-wise optimizer updates every element from that element's gradient
and state alone, so running it on any slice of a flattened array is exact.
Shape-aware optimizers (Muon's Newton-Schulz, Adafactor's factored second
moment) need whole matrices; running them on a flat shard silently changes
their math, so they are refused rather than approximated.
"""

import mlx.optimizers as optim

#: Optimizer classes known to be element-wise (exact on flat shards).
ELEMENTWISE = (
    optim.SGD,
    optim.RMSprop,
    optim.Adagrad,
    optim.AdaDelta,
    optim.Adam,
    optim.AdamW,
    optim.Adamax,
    optim.Lion,
)


def is_elementwise(optimizer) -> bool:
    """Whether ``optimizer``'s update is known to be element-wise.

    Only the exact classes listed in :data:`ELEMENTWISE` count: a subclass may
    override ``apply_single`` with shape-aware math.
    """
    return type(optimizer) in ELEMENTWISE


def check_supported(optimizer):
    """Raise a clear error for an optimizer that cannot run on flat shards."""
    parts = optimizer.optimizers if isinstance(optimizer, optim.MultiOptimizer) else [optimizer]
    for o in parts:
        if not is_elementwise(o):
            known = ", ".join(c.__name__ for c in ELEMENTWISE)
            raise ValueError(
                f"{type(o).__name__} is not known to be element-wise, and running it "
                "on flat shards could silently change its math (Muon and Adafactor "
                f"need whole matrices). The sharded step supports {known}; use "
                "ddp_step for other optimizers."
            )
