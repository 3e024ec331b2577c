"""The optimizers the planner knows, built exactly as a training script would.

Their state is never guessed: the planner initializes these real
``mlx.optimizers`` objects on shape-only arrays and reads the state they
build. Hyper-parameters do not change the state's layout, except where
noted.
"""

from typing import Dict

import mlx.optimizers as optim

#: Path components of arrays that Muon leaves to AdamW: embeddings and output
#: heads are lookup tables and classifiers, not hidden linear maps.
NOT_MUON = ("embed", "embed_tokens", "pos", "wte", "wpe", "head", "lm_head", "output")


def muon_filter(path: str, array) -> bool:
    """Whether the ``muon`` optimizer gives ``array`` to Muon (else to AdamW).

    Muon takes arrays of >= 2 dimensions whose path has no component in
    :data:`NOT_MUON`; the rest (vectors, embeddings, heads) go to AdamW.
    """
    return array.ndim >= 2 and not any(part in NOT_MUON for part in path.split("."))


#: name -> (description, factory of a fresh optimizer).
OPTIMIZERS: Dict[str, tuple] = {
    "adamw": ("AdamW (m, v)", lambda: optim.AdamW(learning_rate=1e-3)),
    "adam": ("Adam (m, v)", lambda: optim.Adam(learning_rate=1e-3)),
    "sgd": ("SGD with momentum 0.9 (v)", lambda: optim.SGD(learning_rate=1e-2, momentum=0.9)),
    "lion": ("Lion (m)", lambda: optim.Lion(learning_rate=1e-4)),
    "muon": (
        "Muon on hidden matrices, AdamW on the rest",
        lambda: optim.MultiOptimizer(
            [optim.Muon(learning_rate=0.02), optim.AdamW(learning_rate=1e-3)], [muon_filter]
        ),
    ),
    # beta_1=None (the default) keeps no first moment; matrices get factored
    # row and column statistics.
    "adafactor": ("Adafactor (factored second moment)", lambda: optim.Adafactor(learning_rate=1e-3)),
}


def make(name: str) -> optim.Optimizer:
    """A fresh optimizer of the kind ``name`` names (a key of :data:`OPTIMIZERS`)."""
    if name not in OPTIMIZERS:
        raise ValueError(
            f"optimizer={name!r} is not one the planner knows; use one of "
            f"{', '.join(OPTIMIZERS)}."
        )
    return OPTIMIZERS[name][1]()

