"""LoRA: a frozen base with trained low-rank adapters, as mlx-lm trains it.

``mlx_lm.lora`` (``--fine-tune-type lora``) freezes the model, then, in the
last ``--num-layers`` blocks, replaces every ``Linear`` by a ``LoRALinear``
that keeps it as ``linear`` and adds ``lora_a`` (``input_dims x rank``) and
``lora_b`` (``rank x output_dims``), both trained
(``mlx_lm.tuner.utils.linear_to_lora_layers`` with its default keys). The
planner does the same to the shapes: the base arrays stay, frozen (held,
gathered and sharded like any parameter, but with no gradient, optimizer
state or master), and the adapters are the trainable arrays.

The activations are counted as for full fine-tuning, an upper bound: the
frozen blocks before the first adapter keep less, and the adapters' own
``rank``-wide products are small next to a block's. On top come one
block's adapted outputs (:func:`adapter_activations`): each adapted
``Linear`` adds its low-rank product to the base output, a second output
alive next to the first while the block runs (measured 1.5 MiB above the
count without it, every block adapted, batch 2 x 128:
``benchmarks/bench_lora_memory.py``).
"""

from dataclasses import replace
from typing import List

from .fully import split
from .shapes import Array, Model


def blocks(model: Model) -> List[str]:
    """The block prefixes (``model.layers.3.``), in tree order, as ``fully_shard`` wraps them."""
    return [prefix for prefix, _ in split([a.path for a in model.arrays]) if prefix]


def with_lora(model: Model, rank: int = 8, num_layers: int = 16) -> Model:
    """``model`` as ``mlx_lm.lora`` trains it: frozen, with adapters in its last blocks.

    Args:
        model (Model): The model.
        rank (int): The adapters' rank (mlx-lm's ``lora_parameters.rank``). Default: ``8``.
        num_layers (int): How many of the last blocks get adapters; ``-1``: all
            (mlx-lm's ``--num-layers``). Default: ``16``.

    Returns:
        Model: The base arrays frozen (each ``Linear``'s under ``.linear``), the
        adapters trainable, in the base arrays' dtype.
    """
    if rank < 1:
        raise ValueError(f"LoRA rank {rank} must be >= 1; mlx-lm's default is 8.")
    if num_layers < -1 or num_layers == 0:
        raise ValueError(f"num_layers={num_layers} must be >= 1, or -1 for every block.")
    quantized = [a.path for a in model.arrays if a.path.endswith(".scales")]
    if quantized:
        raise ValueError(f"{model.name} is quantized ({quantized[0]}); the planner does not "
                         "plan LoRA on quantized models (QLoRA) yet: plan the unquantized one.")
    every = blocks(model)
    adapted = set(every[-num_layers:] if num_layers != -1 else every)
    weights = {a.path[:-len(".weight")] for a in model.arrays
               if a.path.endswith(".weight") and len(a.shape) == 2
               and any(a.path.startswith(b) for b in adapted)}
    arrays, shape = [], {}
    for i, a in enumerate(model.arrays):
        module, _, name = a.path.rpartition(".")
        if module not in weights:
            arrays.append(replace(a, frozen=True))
            continue
        arrays.append(replace(a, path=f"{module}.linear.{name}", frozen=True))
        if name == "weight":
            shape[module] = a.shape
        following = model.arrays[i + 1].path.rpartition(".")[0] \
            if i + 1 < len(model.arrays) else None
        if following != module:  # after the base Linear's arrays, as LoRALinear orders them
            out_dims, in_dims = shape[module]
            # Factors of products, not Linear weights: row-major gradients.
            arrays += [Array(f"{module}.lora_a", (in_dims, rank), a.dtype, transposed=False),
                       Array(f"{module}.lora_b", (rank, out_dims), a.dtype, transposed=False)]
    trained = sum(a.shape[0] * a.shape[1] for a in arrays if not a.frozen)
    name = (f"{model.name}, LoRA rank {rank} on {len(adapted)} of {len(every)} blocks "
            f"({trained / 1e6:.2f}M trained parameters)")
    return Model(name, tuple(arrays), model.heads)


def adapter_activations(model: Model, batch: int, seq: int, itemsize: int) -> int:
    """Bytes of the fullest adapted block's extra outputs for ``batch x seq`` tokens.

    Args:
        model (Model): The model, as :func:`with_lora` gives it (``0`` without adapters).
        batch (int): Sequences.
        seq (int): Tokens per sequence.
        itemsize (int): Bytes per activation element.
    """
    per_block, every = {}, blocks(model)
    for a in model.arrays:
        if a.path.endswith(".lora_b"):
            block = next((b for b in every if a.path.startswith(b)), "")
            per_block[block] = per_block.get(block, 0) + a.shape[1]
    return max(per_block.values(), default=0) * batch * seq * itemsize
