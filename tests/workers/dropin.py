"""fsdp_apply_gradients called as MLX 0.31's mlx.nn.fsdp_apply_gradients was."""

from common import OPTIMIZERS, averaged_grads, batch, loss_fn, make_model, max_diff, reference_clip, report

import mlx.core as mx
import mlx.nn as nn

from mlx_fsdp import fsdp_apply_gradients

group = mx.distributed.init()
n, rank = group.size(), group.rank()
model, ref_model = make_model(bf16=False), make_model(bf16=False)
opt, ref = OPTIMIZERS["adamw"](), OPTIMIZERS["adamw"]()
worst, norm_err = 0.0, 0.0
for step in range(4):
    _, grads = nn.value_and_grad(model, loss_fn)(model, *batch(step, rank))
    if step % 2 == 0:
        # The 0.31 call without clipping returns only the parameters.
        params = fsdp_apply_gradients(grads, model.parameters(), opt)
        plain_is_tree = isinstance(params, dict)
        g = averaged_grads(ref_model, step, n)
    else:
        params, grad_norm = fsdp_apply_gradients(
            grads, model.parameters(), opt, max_norm=0.5
        )
        g, ref_norm = reference_clip(averaged_grads(ref_model, step, n), 0.5)
        norm_err = max(norm_err, abs(grad_norm.item() - ref_norm.item()))
    model.update(params)
    ref.update(ref_model, g)
    mx.eval(model.parameters(), ref_model.parameters(), opt.state, ref.state)
    worst = max(worst, max_diff(model.parameters(), ref_model.parameters()))
report(group, n=n, max_diff=worst, norm_err=norm_err, plain_is_tree=plain_is_tree, norm_shape=list(grad_norm.shape))
