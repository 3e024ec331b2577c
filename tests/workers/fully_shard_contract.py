"""mlx.nn.fully_shard's contract, kept by mlx_fsdp.fully_shard.

Usage: fully_shard_contract.py

* The gradients that ``nn.value_and_grad`` returns sit under ``"module"`` and
  are this rank's axis-0 slices of the gradients ``mlx.nn.average_gradients``
  gives a plain copy of the model: in float32, and with
  ``compute_dtype=mx.bfloat16`` (against a copy computed in bfloat16).
* With ``MLX_FSDP_TEST_EMULATE_SUM_SCATTER`` set (sum_scatter as all_sum and
  a slice, what NCCL and JACCL return), ``mlx.nn.fully_shard`` itself runs
  here: on a model whose axis 0 divides by N, both give the same loss and the
  same gradients, under the same paths.
"""

import os

from common import report

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

import mlx_fsdp
from mlx_fsdp import rows


class Net(nn.Module):
    def __init__(self, width: int, classes: int, vocab: int, gain=()):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = [nn.Linear(width, width) for _ in range(2)]
        self.gain = mx.full(gain, 1.25)
        self.head = nn.Linear(width, classes)

    def __call__(self, ids):
        h = self.embed(ids)
        for b in self.blocks:
            h = nn.gelu(b(h)) + h
        return self.head(h * self.gain)


def loss_fn(model, ids, y):
    return nn.losses.cross_entropy(model(ids), y, reduction="mean")


def make(width, classes, vocab, dtype=None, gain=()):
    mx.random.seed(3)
    net = Net(width, classes, vocab, gain)
    if dtype is not None:
        net.set_dtype(dtype)
    mx.eval(net.parameters())
    return net


def shard(net, wrap, **kw):
    for i, b in enumerate(net.blocks):
        net.blocks[i] = wrap(b, **kw)
    return wrap(net, **kw)


def data(rank, classes, vocab):
    key = mx.random.key(50 + rank)
    return (mx.random.randint(0, vocab, (3, 5), key=key),
            mx.random.randint(0, classes, (3, 5), key=mx.random.split(key)[0]))


def plain(path):
    return path.replace("module.", "")


def slice_diff(grads, reference, n, rank):
    """Largest |grad - this rank's axis-0 slice of the reference|; and the dtypes seen."""
    ref = dict(tree_flatten(reference))
    worst, dtypes = 0.0, set()
    for path, g in tree_flatten(grads):
        full = ref[plain(path)]
        lo, hi = rows.held_rows(full.shape, rows.chunk(full.shape, n), rank)
        want = full[lo:hi] if full.ndim else (full if hi > lo else full.reshape(-1)[:0])
        assert g.shape == want.shape, (path, g.shape, want.shape)
        dtypes.add(str(g.dtype))
        if g.size:
            worst = max(worst, mx.abs(g.astype(mx.float32) - want.astype(mx.float32)).max().item())
    return worst, sorted(dtypes)


def main():
    group = mx.distributed.init()
    n, rank = group.size(), group.rank()
    ids, y = data(rank, 7, 22)
    out = {}
    # float32: odd shapes (23 and 7 rows: the last ranks' slices are shorter, or empty)
    ours = shard(make(23, 7, 22), mlx_fsdp.fully_shard)
    _, grads = nn.value_and_grad(ours, loss_fn)(ours, ids, y)
    ref_net = make(23, 7, 22)
    _, ref = nn.value_and_grad(ref_net, loss_fn)(ref_net, ids, y)
    out["f32"], out["f32_dtypes"] = slice_diff(grads, nn.average_gradients(ref), n, rank)
    out["paths"] = sorted(p for p, _ in tree_flatten(grads))
    # bfloat16 compute: gathered and reduced in bfloat16, kept in float32
    ours = shard(make(23, 7, 22), mlx_fsdp.fully_shard, compute_dtype=mx.bfloat16)
    _, grads = nn.value_and_grad(ours, loss_fn)(ours, ids, y)
    low = make(23, 7, 22, mx.bfloat16)
    _, ref = nn.value_and_grad(low, loss_fn)(low, ids, y)
    out["bf16"], out["bf16_dtypes"] = slice_diff(grads, nn.average_gradients(ref), n, rank)
    if os.environ.get("MLX_FSDP_TEST_EMULATE_SUM_SCATTER"):
        width, classes = 8 * n, 4 * n  # MLX's needs every axis 0 to divide by N
        # and refuses scalars: the gain is a vector there
        mine = shard(make(width, classes, 3 * n, gain=(width,)), mlx_fsdp.fully_shard)
        theirs = shard(make(width, classes, 3 * n, gain=(width,)), nn.fully_shard)
        ids, y = data(rank, classes, 3 * n)
        l1, g1 = nn.value_and_grad(mine, loss_fn)(mine, ids, y)
        l2, g2 = nn.value_and_grad(theirs, loss_fn)(theirs, ids, y)
        a, b = dict(tree_flatten(g1)), dict(tree_flatten(g2))
        out["mlx_same_paths"] = sorted(a) == sorted(b)
        out["mlx_loss"] = abs(l1.item() - l2.item())
        out["mlx_grads"] = max(mx.abs(a[p] - b[p]).max().item() for p in a if p in b)
        out["method"] = mlx_fsdp.reduce_scatter_method(group)
    report(group, **out)


main()
