"""Activations: what a Llama-style forward and backward pass keeps for one batch.

``mlx.nn.value_and_grad`` keeps every array a later gradient needs until
the backward pass reaches it. For one decoder layer (mlx-lm's ``llama``:
RMS norm, grouped-query attention with RoPE, SwiGLU MLP) that is, per
token, in the parameters' dtype: the layer's input and its two normalized
copies, the queries, keys and values before and after RoPE, the attention
output (and its contiguous copy), the residual sum, the gate, up and SwiGLU
products and the MLP's output, 8, 2 and 3 arrays of ``dims``, ``kv_dims``
and ``ffn``; :data:`PER_LAYER` counts them, and what the CPU's backward
pass allocates ahead of its worker on top.

Attention's ``heads x seq x seq`` scores: under ``mx.grad``, MLX computes
``mx.fast.scaled_dot_product_attention`` with its unfused operations on every
device (its ``use_fallback`` while tracing gradients, CUDA's included), so
every layer keeps its scores and probabilities (float32) for its backward
pass (:data:`SCORES`).

The head's logits (``batch x seq x vocab``) and the loss's gradient of them
(:data:`LOGITS` copies), and, in the backward pass of the fullest layer,
its gradients of what it kept (:data:`BACKWARD` times a layer's
activations), come on top.

With ``mx.checkpoint`` around every block (``checkpoint=True``, as
``mlx_lm.tuner.trainer.grad_checkpoint`` wraps them), a block keeps only
its input, and the backward pass recomputes one block's activations at a
time. ``fully_shard``'s resharded blocks do the same: each runs again in
the backward pass as it gathers its parameters again
(:mod:`mlx_fsdp.fully_sharded.remat`), so they are counted checkpointed
(:func:`pass_of`); on the CPU, where that backward pass is paced a block
at a time, with :data:`PACED` in place of :data:`BACKWARD`.
On a GPU the count is the CPU's and what runs ahead: MLX's GPU backends
keep an operation's inputs until its batch of kernels has run, so an
evaluation that nothing cuts holds layers more (:data:`GPU_QUEUED`);
collectives that the CPU runs between ``fully_shard``'s blocks (ring, MPI,
JACCL) cut it a block at a time (:data:`GPU_PACED`).

``benchmarks/bench_activations.py`` measures a real mlx-lm model against
these counts, ``benchmarks/bench_plan_memory.py --models llama`` whole
fully sharded steps.
"""

from typing import NamedTuple

from .buffers import BACKENDS, DEVICES
from .phases import phases_apart

#: The backends whose collectives the CPU runs, between a GPU's kernels.
CPU_COLLECTIVES = ("ring", "mpi", "jaccl")

#: Arrays one layer keeps per token, in units of (dims, kv_dims, ffn): what
#: it keeps (8, 2, 3 by the list above) and what the CPU's backward pass
#: allocates ahead of its worker, which grows with the operations' size.
#: Fitted as an upper bound to mlx-lm's llama on the CPU
#: (``benchmarks/bench_activations.py``, 2026-11-27: 160 points, five shapes
#: of 2 to 8 layers of 128 to 512, batches 1 x 128 to 16 x 128 and 4 x 512,
#: float32 and bfloat16, with and without ``mx.checkpoint``). Counted as
#: kept, (8, 2, 3), batches of 16 x 64 to 16 x 128 measured up to 1.17x
#: above the count: those are the sizes that train.
PER_LAYER = (11, 4, 4)
#: Arrays of ``batch x heads x seq x seq`` scores per layer, in the
#: activations' dtype, kept by every layer. On an H100 (2026-11-28, the
#: points of :data:`GPU_QUEUED`) a longer sequence at the same tokens added
#: about 1.4 per layer.
SCORES = 1.5
#: Copies of the ``batch x seq x vocab`` logits alive at once: the logits, the
#: loss's softmax and their gradients (without, with ``mx.checkpoint``).
LOGITS = (2, 3)
#: The backward pass of the fullest block, in its kept activations: its
#: gradients (and with ``mx.checkpoint`` its recomputed activations too).
BACKWARD = (1, 2.5)
#: The same for a block recomputed in a backward pass paced a block at a
#: time (``fully_shard``'s resharded blocks on the CPU): its kept
#: activations, then more arrays of its scores (the unfused attention's
#: backward). Fitted as an upper bound with 3% to spare to 54 fully sharded
#: steps of mlx-lm's llama (``bench_plan_memory.py --models llama
#: --reshard-after-forward on``, 2026-11-28: 2 to 8 layers of 128 to 512,
#: batches 1 x 128 to 16 x 64 and 1 x 1024, float32 and bfloat16, ring N=2
#: and MPI N=3, SGD, AdamW and Muon), which needed 0.2 to 1.95 kept layers
#: (the most at 1 x 1024, where the scores are most of a layer), against
#: 2.5 unpaced: paced, one block's recomputation is queued at a time.
PACED = (1.5, 1.5)
#: On a GPU, an evaluation that nothing cuts: layers' activations (kept, as
#: :data:`PER_LAYER` and :data:`SCORES` count one) on top of the CPU's count,
#: with or without ``mx.checkpoint``: the inputs of the operations queued
#: ahead, which MLX's GPU backends keep until their batch of kernels has run.
#: Fitted as an upper bound to mlx-lm's llama on one NVIDIA H100 (2026-11-28,
#: ``bench_activations.py --layers 4 --dims 256 --ffn 704 --vocab 256
#: --checkpoint off remat``, one process, float32, batches 1 x 128 to 1 x 1024),
#: which needed 1.5 to 4.3 layers more. Added, not a factor: up to
#: ``transient.GPU_IN_FLIGHT_OPS`` (240) operations run ahead on a GPU, where
#: the CPU's count has 50, so what they hold grows with the tokens and the
#: width, not the depth (one layer's pass is about 310 operations). Measured
#: on one shape only; MLX also waits for queued work past its memory limit.
#: Apple GPUs batch differently and are not measured.
GPU_QUEUED = 4.5
#: On a GPU, the pass of ``fully_shard``'s blocks over collectives the CPU
#: runs: its activations over the CPU's unpaced count. Fitted to 16 fully
#: sharded steps of mlx-lm's llama on the same H100 (``bench_plan_memory.py
#: --models llama``, ring N=2, 2 to 8 layers of 128 to 384, batches 8 x 128 to
#: 2 x 512, float32 and bfloat16, SGD and AdamW, with and without
#: resharding), which needed up to 1.13 of it.
GPU_PACED = 1.15
#: Bytes of half-precision activations per nominal byte (float32 steps inside).
HALF = 1.2
#: What a checkpointed block keeps, in units of ``dims`` per token.
CHECKPOINTED = 3


class Shape(NamedTuple):
    """What the activations depend on: a Llama-style model's dimensions.

    Attributes:
        layers (int): Decoder layers.
        dims (int): Model width.
        ffn (int): MLP hidden width.
        vocab (int): Vocabulary size.
        heads (int): Attention heads.
        kv_heads (int): Key/value heads.
    """

    layers: int
    dims: int
    ffn: int
    vocab: int
    heads: int
    kv_heads: int


def activation_bytes(shape: Shape, batch_size: int, seq_len: int, itemsize: int,
                     checkpoint: bool = False, device: str = "gpu", paced: bool = False) -> int:
    """Bytes the forward and backward pass of one batch holds at its fullest.

    Args:
        shape (Shape): The model's dimensions.
        batch_size (int): Sequences per batch (mlx-lm's ``--batch-size``).
        seq_len (int): Tokens per sequence (mlx-lm's ``--max-seq-length``).
        itemsize (int): Bytes per element of the activations (the
            parameters' dtype).
        checkpoint (bool): ``mx.checkpoint`` around every block. Default: ``False``.
        device (str): ``"cpu"`` or ``"gpu"`` (see the module docstring).
            Default: ``"gpu"``.
        paced (bool): The pass is held back a block at a time: on the CPU,
            checkpointed blocks recompute in a backward pass paced so
            (:data:`PACED`); on a GPU, collectives the CPU runs cut the pass at
            every block (:data:`GPU_PACED`; else :data:`GPU_QUEUED`).
            :func:`pass_of` says which. Default: ``False``.

    Returns:
        int: Bytes; 0 when ``batch_size`` or ``seq_len`` is 0.
    """
    for key, value in dict(batch_size=batch_size, seq_len=seq_len).items():
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{key}={value!r} must be an integer >= 0; pass the batch "
                             "size and sequence length you train with (0: no activations).")
    if device not in DEVICES:
        raise ValueError(f"device={device!r} must be one of {', '.join(DEVICES)}.")
    tokens = batch_size * seq_len
    if tokens == 0:
        return 0
    gpu = device == "gpu"
    # Half-precision activations: softmax, norms and the loss take float32
    # steps, measured at 0.57-0.60 of float32's bytes, not 0.5.
    itemsize = itemsize * HALF if itemsize < 4 else itemsize
    kv_dims = shape.kv_heads * (shape.dims // shape.heads)
    c_d, c_kv, c_f = PER_LAYER
    scores = batch_size * shape.heads * seq_len * seq_len * itemsize
    layer = (tokens * (c_d * shape.dims + c_kv * kv_dims + c_f * shape.ffn) * itemsize
             + SCORES * scores)
    logits = tokens * shape.vocab * itemsize
    ck = int(checkpoint)
    blocks = CHECKPOINTED * tokens * shape.dims * itemsize if checkpoint else layer
    if checkpoint and paced and not gpu:
        backward = PACED[0] * layer + PACED[1] * scores
    else:
        backward = BACKWARD[ck] * layer
    count = shape.layers * blocks + LOGITS[ck] * logits + backward
    if gpu:
        count = count * GPU_PACED if paced else count + GPU_QUEUED * layer
    return int(count)


def pass_of(mode: str, wrap: str = "blocks", reshard_after_forward: bool = False,
            compiled: bool = False, device: str = "gpu", checkpoint: bool = False,
            backend: str = "ring", world_size: int = 2) -> dict:
    """:func:`activation_bytes`'s ``checkpoint`` and ``paced`` for a ``mode`` step.

    ``fully_shard``'s blocks resharded after their forward pass (``wrap``
    ``"blocks"``) recompute their activations as ``mx.checkpoint``'s do,
    compiled or not, unless there is one rank, where ``fully_shard`` leaves
    the model as it is. On the CPU their backward pass is paced a block at a
    time (:mod:`mlx_fsdp.pace`), and counted so where it is not compiled; on
    a GPU, the blocks' collectives pace the eager pass where the CPU runs
    them (every backend but NCCL), resharded or not.

    Args:
        mode (str): ``"ddp"``, ``"fsdp"`` or ``"fully_shard"``.
        wrap (str): How ``fully_shard`` wraps the model. Default: ``"blocks"``.
        reshard_after_forward (bool): The blocks' argument. Default: ``False``.
        compiled (bool): The step is compiled whole. Default: ``False``.
        device (str): ``"cpu"`` or ``"gpu"``. Default: ``"gpu"``.
        checkpoint (bool): ``mx.checkpoint`` around every block besides.
            Default: ``False``.
        backend (str): The ranks' ``mx.distributed`` backend: ``"ring"``,
            ``"mpi"``, ``"jaccl"`` or ``"nccl"``. Default: ``"ring"``.
        world_size (int): Ranks. Default: ``2`` (any N above 1 counts alike).

    Returns:
        dict: ``{"checkpoint": bool, "paced": bool}``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {', '.join(BACKENDS)}.")
    blocks = mode == "fully_shard" and wrap == "blocks" and world_size > 1
    resharded = blocks and reshard_after_forward
    if device == "gpu":
        paced = blocks and not compiled and backend in CPU_COLLECTIVES
    else:
        paced = resharded and phases_apart(device, compiled)
    return {"checkpoint": checkpoint or resharded, "paced": paced}


def llama_shape(model) -> Shape:
    """The :class:`Shape` of a :class:`~mlx_fsdp.plan_memory.shapes.Model` with mlx-lm's
    Llama paths (``model.layers.N.self_attn.q_proj.weight``, ...), LoRA-adapted or not.

    Raises:
        ValueError: Where the paths are not a Llama-style decoder's.
    """
    # A LoRA-adapted Linear keeps its base weight under ``.linear`` (mlx-lm's
    # LoRALinear): with every block adapted no block has the plain path.
    by_path = {a.path.replace(".linear.weight", ".weight"): a.shape for a in model.arrays}
    layers = 1 + max((int(p.split(".")[2]) for p in by_path if p.startswith("model.layers.")),
                     default=-1)
    try:
        q = by_path["model.layers.0.self_attn.q_proj.weight"]
        k = by_path["model.layers.0.self_attn.k_proj.weight"]
        ffn = by_path["model.layers.0.mlp.gate_proj.weight"][0]
        vocab, dims = by_path["model.embed_tokens.weight"]
    except KeyError:
        raise ValueError(
            f"{model.name} is not a Llama-style decoder (no model.layers.0.self_attn."
            "q_proj.weight, mlp.gate_proj.weight or model.embed_tokens.weight), so its "
            "activations are unknown; leave out --batch-size and --seq-len, or describe "
            "it with --params/--layers/--dims/--ffn/--vocab/--heads."
        ) from None
    heads = getattr(model, "heads", None) or max(1, dims // 128)
    kv_heads = max(1, heads * k[0] // q[0])
    return Shape(layers, dims, ffn, vocab, heads, kv_heads)
