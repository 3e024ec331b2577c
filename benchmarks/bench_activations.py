"""The planner's activations against a real mlx-lm Llama's forward and backward pass.

For each size: build ``mlx_lm.models.llama.Model`` from a config, run
``nn.value_and_grad`` of mlx-lm's cross-entropy on a random batch (one
``mx.eval`` of the loss and the gradients), and compare
``mx.get_peak_memory()`` less the parameters (the activations) with :func:`mlx_fsdp.plan_memory.activations.activation_bytes`.
``--checkpoint on`` wraps every block in ``mx.checkpoint`` as
``mlx_lm.tuner.trainer.grad_checkpoint`` does; ``remat`` recomputes every
block as ``fully_shard``'s resharded blocks do
(:func:`mlx_fsdp.fully_sharded.remat.remat`, unpaced: one process), counted
as ``mx.checkpoint``'s. The gradients made by the pass's fullest moment are
in what is measured, so it is an upper bound of the activations alone. One
process, no ranks.

    python benchmarks/bench_activations.py
    python benchmarks/bench_activations.py --sizes 2x128 4x256 --checkpoint off on --dtype bfloat16
"""

import argparse
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from mlx_fsdp.fully_sharded.remat import remat  # noqa: E402
from mlx_fsdp.plan_memory.activations import Shape, activation_bytes  # noqa: E402
from mlx_fsdp.plan_memory.buffers import default_device  # noqa: E402

MiB = 1024**2


def build(shape: Shape, dtype: str, checkpoint: bool):
    """An mlx-lm Llama of ``shape``, every block under ``mx.checkpoint`` if asked."""
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=shape.dims,
                           num_hidden_layers=shape.layers, intermediate_size=shape.ffn,
                           num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                           rms_norm_eps=1e-5, vocab_size=shape.vocab, tie_word_embeddings=False)
    model = llama.Model(args)
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    if checkpoint:
        # Imported only here: mlx_lm.tuner pulls in transformers, which the
        # model alone does not need.
        from mlx_lm.tuner.trainer import grad_checkpoint

        grad_checkpoint(model.layers[0])
    return model


class Recomputed(nn.Module):
    """A block recomputed in the backward pass by ``fully_shard``'s own rule."""

    def __init__(self, block):
        super().__init__()
        self.block = block
        self.use_sliding = getattr(block, "use_sliding", False)  # mlx-lm's Llama asks

    def __call__(self, *args, **kwargs):
        def body(params, *a, **k):
            saved = self.block.trainable_parameters()
            self.block.update(params)
            try:
                return self.block(*a, **k)
            finally:
                self.block.update(saved)
        return remat(body, self.block.trainable_parameters(), *args, **kwargs)


def measure(shape: Shape, batch: int, seq: int, dtype: str, checkpoint, repeat: int) -> int:
    """Peak bytes of forward and backward less the parameters (max of runs); the
    gradients made by then are in it. ``checkpoint``: ``False``, ``True`` or ``"remat"``."""
    model = build(shape, dtype, checkpoint is True)
    if checkpoint == "remat":
        model.model.layers = [Recomputed(b) for b in model.model.layers]
    tokens = mx.random.randint(0, shape.vocab, (batch, seq + 1), key=mx.random.key(0))

    def loss(m):
        logits = m(tokens[:, :-1])
        return nn.losses.cross_entropy(logits, tokens[:, 1:]).astype(mx.float32).mean()

    step = nn.value_and_grad(model, loss)
    mx.eval(tokens)
    state = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
    worst = 0
    for _ in range(repeat):
        gc.collect()
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        value, grads = step(model)
        mx.eval(value, grads)
        worst = max(worst, mx.get_peak_memory() - before - state)
        del value, grads
    if checkpoint is True:  # grad_checkpoint patched the class: undo it for the next model
        from mlx_lm.models import llama
        llama.TransformerBlock.__call__ = llama.TransformerBlock.__call__.__closure__[0].cell_contents
    return worst


def add_shape_args(p: argparse.ArgumentParser, layers: int = 2):
    """The Llama's shape flags and the ``--sizes`` of the batches to measure."""
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--dims", type=int, default=256)
    p.add_argument("--ffn", type=int, default=704)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--sizes", nargs="+", default=["1x64", "2x128", "4x256"],
                   help="BATCHxSEQ points (default 1x64 2x128 4x256)")


def shape_of(args) -> Shape:
    return Shape(args.layers, args.dims, args.ffn, args.vocab, args.heads, args.kv_heads)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(p)
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=("float32", "bfloat16"))
    p.add_argument("--checkpoint", nargs="+", default=["off", "on"], choices=("off", "on", "remat"),
                   help="off, on (mx.checkpoint per block), remat (fully_shard's recomputation)")
    p.add_argument("--repeat", type=int, default=2, help="runs per point; the peak is the highest")
    args = p.parse_args(argv)
    shape = shape_of(args)
    device = default_device()
    print(f"mlx-lm llama {shape}, {device}; activations = peak - parameters (the gradients made by then in it)")
    print("| dtype | batch x seq | checkpoint | predicted MiB | measured MiB | predicted / measured |")
    print("|---|---|---|---:|---:|---:|")
    ratios = []
    for dtype in args.dtype:
        for size in args.sizes:
            batch, seq = map(int, size.split("x"))
            for ck in args.checkpoint:
                got = measure(shape, batch, seq, dtype,
                              {"off": False, "on": True}.get(ck, ck), args.repeat)
                want = activation_bytes(shape, batch, seq, getattr(mx, dtype).size,
                                        ck != "off", device)
                ratios.append(want / got)
                print(f"| {dtype} | {size} | {ck} | {want / MiB:.2f} | {got / MiB:.2f} | "
                      f"{want / got:.3f} |", flush=True)
    print(f"predicted / measured: lowest {min(ratios):.3f}, highest {max(ratios):.3f}")


if __name__ == "__main__":
    main()
