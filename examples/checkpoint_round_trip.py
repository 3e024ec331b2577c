"""Save a fully sharded model at one world size, load it at another.

    mlx.launch -n 2 --backend ring -- python examples/checkpoint_round_trip.py save ck
    python examples/checkpoint_round_trip.py load ck          # one process, unsharded
    mpirun -n 3 python examples/checkpoint_round_trip.py load ck

Rank 0 prints the step and the sum of the squared weights (gathered with
``mlx_fsdp.full_parameters`` on every rank): equal after every load.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

import mlx_fsdp  # noqa: E402


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = [nn.Linear(256, 256) for _ in range(4)]
        self.head = nn.Linear(256, 10)

    def __call__(self, x):
        for layer in self.layers:
            x = nn.relu(layer(x))
        return self.head(x)


def build(seed: int):
    mx.random.seed(seed)
    model = Net()
    for i in range(len(model.layers)):
        model.layers[i] = mlx_fsdp.fully_shard(model.layers[i])
    model = mlx_fsdp.fully_shard(model)  # the head
    return model, mlx_fsdp.fsdp_step(optim.AdamW(learning_rate=1e-3))


def main():
    group = mx.distributed.init()
    mode, path = sys.argv[1], sys.argv[2]
    model, opt = build(0 if mode == "save" else 1)  # a load starts from other weights
    if mode == "save":
        x, y = mx.random.normal((8, 256)), mx.random.randint(0, 10, (8,))
        loss, grads = nn.value_and_grad(
            model, lambda m, x, y: nn.losses.cross_entropy(m(x), y).mean())(model, x, y)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)
        mlx_fsdp.save_checkpoint(path, model, opt)
    else:
        mlx_fsdp.load_checkpoint(path, model, opt)
    full = mlx_fsdp.full_parameters(model)  # every rank calls it: a collective
    norm = sum((a.astype(mx.float32) ** 2).sum() for _, a in tree_flatten(full))
    if group.rank() == 0:
        print(f"N={group.size()} {mode}: step {opt.step.item()}, |weights|^2 = {norm.item():.6f}")


if __name__ == "__main__":
    main()
