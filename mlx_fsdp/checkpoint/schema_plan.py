"""The manifest's optimizer description and plan, checked (a part of :mod:`.schema`).

The plan is checked against the optimizer description (each bucket's
sub-optimizer exists) and against itself (each path and slot index once,
each size the product of its shape); :mod:`.schema` checks the rest of the
manifest against the slots it returns.
"""

import math
from typing import Dict

from .fields import Fields

ORDERS = ("C", "F")


def optimizer_section(f: Fields, desc, where: str) -> int:
    """The optimizer description; returns how many state sections it needs."""
    f.dict(desc, where)
    f.str(f.get(desc, "class", where), f"{where}.class")
    f.str(f.get(desc, "module", where, optional=True, default="-"), f"{where}.module")
    f.dict(f.get(desc, "hyperparameters", where, optional=True, default={}),
           f"{where}.hyperparameters")
    for i, name in enumerate(f.list(f.get(desc, "scheduled", where, optional=True, default=[]),
                                    f"{where}.scheduled")):
        f.str(name, f"{where}.scheduled[{i}]")
    subs = f.get(desc, "sub_optimizers", where, optional=True)
    if subs is None:
        return 1
    f.list(subs, f"{where}.sub_optimizers")
    if not subs:
        f.fail(f"{where}.sub_optimizers", "is empty")
    for i, sub in enumerate(subs):
        if optimizer_section(f, sub, f"{where}.sub_optimizers[{i}]") != 1:
            f.fail(f"{where}.sub_optimizers[{i}]", "nests another MultiOptimizer")
    return len(subs)


def plan_section(f: Fields, plan, num_optimizers: int) -> Dict[str, tuple]:
    """The plan; returns ``{path: (optimizer index, slot, param dtype)}``."""
    f.dict(plan, "plan")
    world = f.int(f.get(plan, "world_size", "plan"), "plan.world_size", 1)
    f.int(f.get(plan, "communication_size", "plan"), "plan.communication_size", -(1 << 62))
    slots, indices = {}, set()
    for b, bucket in enumerate(f.list(f.get(plan, "buckets", "plan"), "plan.buckets")):
        where = f"plan.buckets[{b}]"
        f.dict(bucket, where)
        k = f.int(f.get(bucket, "optimizer", where), f"{where}.optimizer", 0, num_optimizers)
        f.dtype(f.get(bucket, "dtype", where), f"{where}.dtype")
        param_dtype = f.dtype(f.get(bucket, "param_dtype", where), f"{where}.param_dtype")
        f.int(f.get(bucket, "cols", where), f"{where}.cols")
        for s, slot in enumerate(f.list(f.get(bucket, "slots", where), f"{where}.slots")):
            at = f"{where}.slots[{s}]"
            f.dict(slot, at)
            path = f.str(f.get(slot, "path", at), f"{at}.path")
            if path in slots:
                f.fail(f"{at}.path", f"repeats {path!r}, which another slot already has")
            index = f.int(f.get(slot, "index", at), f"{at}.index")
            if index in indices:
                f.fail(f"{at}.index", f"repeats {index}, which another slot already has")
            indices.add(index)
            shape = f.shape(f.get(slot, "shape", at), f"{at}.shape")
            f.equal(f.int(f.get(slot, "size", at), f"{at}.size"), math.prod(shape), f"{at}.size",
                    "the product of its shape")
            for name in ("start", "cols", "offset"):  # format 3 has start, 1 and 2 the others
                f.int(f.get(slot, name, at, optional=True, default=0), f"{at}.{name}")
            owner = f.get(slot, "owner", at, optional=True)
            if owner is not None:
                f.int(owner, f"{at}.owner", 0, world)
            f.str(f.get(slot, "order", at, optional=True, default="C"), f"{at}.order", ORDERS)
            slots[path] = (k, slot, param_dtype)
    if not slots:
        f.fail("plan.buckets", "holds no parameter")
    return slots
