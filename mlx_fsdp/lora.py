"""``python -m mlx_fsdp.lora``: ``mlx_lm.lora`` on a sharded optimizer.

Takes every flag of ``mlx_lm.lora`` (and its YAML ``--config``), plus
``--fsdp/--no-fsdp``, ``--fully-shard``, ``--reshard-after-forward``,
``--communication-size``, ``--max-norm``, ``--master-dtype``,
``--accumulation``, ``--checkpoint-dir`` and ``--resume``; ``--save-every``
also saves a sharded checkpoint. Under ``mlx.launch -n N`` it trains with
:func:`mlx_fsdp.fsdp_step`, with no second all-reduce::

    mlx.launch -n 2 --backend ring -- python -m mlx_fsdp.lora --model PATH --data DIR --train

Everything else is mlx-lm's own: model and data loading, LoRA/DoRA layers,
``adapter_config.json``, the trainer, evaluation and ``--test``.
"""

import argparse
import os
import re
import types
from contextlib import nullcontext
from functools import partial

import mlx.core as mx

#: Defaults of the flags this command adds to ``mlx_lm.lora``'s.
FSDP_DEFAULTS = {
    "fsdp": True,
    "fully_shard": False,
    "reshard_after_forward": False,
    "communication_size": None,
    "max_norm": None,
    "master_dtype": None,
    "accumulation": "local",
    "checkpoint_dir": None,
    "resume": False,
}

_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]i?B?|B)?\s*$", re.IGNORECASE)


def parse_size(text) -> int:
    """Bytes from ``33554432``, ``32MiB``, ``512KiB`` or ``32M`` (units are binary)."""
    m = _SIZE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(
            f"size={text!r} is not a byte count; give an integer, optionally with a "
            "unit: 1048576, 1MiB, 512KiB, 32M."
        )
    unit = (m.group(2) or "B")[0].upper()
    return int(m.group(1)) * {"B": 1, "K": 1024, "M": 1024**2, "G": 1024**3}[unit]


_FLAGS = (
    ("--fsdp", dict(
        action=argparse.BooleanOptionalAction,
        help="Shard the optimizer state over the ranks (fsdp_step); --no-fsdp replicates "
             "it (ddp_step). Default: --fsdp.")),
    ("--fully-shard", dict(
        action="store_true",
        help="Also shard the parameters (ZeRO-3): each transformer block, then the model, "
             "is wrapped with mlx_fsdp.fully_shard and gathers its parameters only while "
             "it runs; --save-every saves each rank's shards, and --resume takes a "
             "checkpoint saved with or without it. Needs --fsdp. Default: off.")),
    ("--reshard-after-forward", dict(
        action="store_true",
        help="With --fully-shard: free each block's gathered parameters after its forward "
             "pass and recompute the block in the backward pass. Default: off.")),
    ("--communication-size", dict(
        type=parse_size,
        help="Bytes per communication bucket: 33554432, 32MiB, 512KiB. Default: the "
             "wrapper's (fsdp_step: 4MiB on the CPU, 32MiB on a GPU; ddp_step: 32MiB).")),
    ("--max-norm", dict(
        type=float, help="Clip the gradients to this global norm. Default: no clipping.")),
    ("--master-dtype", dict(
        choices=["float32", "bfloat16", "float16"],
        help="Step parameters of other dtypes through master copies of this dtype (e.g. "
             "float32 for a bfloat16 model). Default: none.")),
    ("--accumulation", dict(
        choices=["local", "sharded"],
        help="With --grad-accumulation-steps > 1: 'local' is mlx-lm's accumulation (full "
             "gradients, reduced once per step); 'sharded' reduces every micro-batch and "
             "keeps 1/N of the sum per rank (fsdp_step's). Default: local.")),
    ("--checkpoint-dir", dict(
        type=str, help="Where to save sharded checkpoints. Default: ADAPTER_PATH/checkpoints.")),
    ("--resume", dict(
        action="store_true",
        help="Continue from the latest checkpoint in --checkpoint-dir, at this or another "
             "number of ranks; --iters is where the whole run ends.")),
)


def build_parser() -> argparse.ArgumentParser:
    """``mlx_lm.lora``'s parser with the flags of the sharded optimizer added."""
    from mlx_lm.lora import build_parser as mlx_lm_parser

    parser = mlx_lm_parser()
    parser.description = "LoRA, QLoRA or full fine-tuning with a sharded (FSDP) optimizer."
    group = parser.add_argument_group(
        "mlx_fsdp",
        "The sharded optimizer and its checkpoints. --save-every also saves a sharded "
        "checkpoint (every rank) to --checkpoint-dir/step-NNNNNNN.",
    )
    for flag, options in _FLAGS:
        # default=None everywhere: a flag not given is taken from --config, then the defaults.
        group.add_argument(flag, default=None, **options)
    return parser


def parse_args(argv=None) -> types.SimpleNamespace:
    """Parse the flags, then fill what is not given from ``--config`` and the defaults.

    As ``mlx_lm.lora`` does: the command line wins over the YAML file, which
    wins over ``mlx_lm.lora.CONFIG_DEFAULTS`` and :data:`FSDP_DEFAULTS`.
    """
    import yaml
    from mlx_lm.lora import CONFIG_DEFAULTS, yaml_loader

    args = vars(build_parser().parse_args(argv))
    if args["config"]:
        with open(args["config"]) as fh:
            config = yaml.load(fh, yaml_loader)
        for k, v in config.items():
            if args.get(k) is None:
                args[k] = v
    for defaults in (CONFIG_DEFAULTS, FSDP_DEFAULTS):
        for k, v in defaults.items():
            if args.get(k) is None:
                args[k] = v
    if args["communication_size"] is not None:
        args["communication_size"] = parse_size(args["communication_size"])
    return types.SimpleNamespace(**args)


def save_model_directory(path: str, model_ref: str, model):
    """Write ``model`` as a model directory ``mlx_lm.load`` opens, with mlx-lm's ``save``.

    A model sharded by :func:`mlx_fsdp.lm.sharding.shard_model` is gathered
    one module at a time (:func:`~mlx_fsdp.lm.sharding.save_whole_weights`),
    so every rank must call this then; otherwise rank 0 alone writes. The
    weight files of an earlier save to ``path`` are removed first.

    Args:
        path (str): The directory to write.
        model_ref (str): The ``--model`` it was loaded from (a directory or a
            Hugging Face repository already in the local cache); gives the
            config and the tokenizer.
        model (mlx.nn.Module): The fine-tuned model, whole or sharded.
    """
    from pathlib import Path

    from mlx_lm.utils import hf_repo_to_path, load_config, load_tokenizer, save

    from .fully_sharded.model import sharded_modules
    from .lm.hooks import weights_written_apart
    from .lm.sharding import save_whole_weights

    sharded = bool(sharded_modules(model))
    if mx.distributed.init().rank() == 0 and os.path.isdir(path):
        # mlx_lm.load reads every model*.safetensors there: an earlier run's
        # files, named otherwise, would mix stale weights into these.
        for name in os.listdir(path):
            if name.startswith("model") and name.endswith((".safetensors", ".index.json")):
                os.remove(os.path.join(path, name))
    if sharded:
        save_whole_weights(path, model)
    if mx.distributed.init().rank() != 0:
        return
    src = Path(model_ref)
    if not src.exists():
        src = hf_repo_to_path(model_ref)
    with weights_written_apart() if sharded else nullcontext():
        save(path, model_ref, model, load_tokenizer(src), load_config(src), donate_model=False)


def _train(options, trained: dict, *, model, args, optimizer, train_dataset,
           val_dataset=None, training_callback=None, **rest):
    # Stands in for mlx-lm's trainer inside mlx_lm.lora.train_model. A fully
    # sharded model stays sharded to the end: a full fine-tune is saved from
    # its shards, and --test evaluates it so (hooks.lora_tests_model).
    from .lm import train

    adapter_path = options.adapter_path
    trained["model"] = train(
        model, optimizer, train_dataset, val_dataset, args,
        training_callback=training_callback, fsdp=options.fsdp,
        fully_shard=bool(options.fully_shard),
        reshard_after_forward=bool(options.reshard_after_forward),
        accumulation=options.accumulation,
        checkpoint_dir=options.checkpoint_dir or os.path.join(adapter_path, "checkpoints"),
        resume=bool(options.resume), log_file=os.path.join(adapter_path, "losses.jsonl"),
        communication_size=options.communication_size, max_norm=options.max_norm,
        master_dtype=getattr(mx, options.master_dtype) if options.master_dtype else None,
        unshard=False, **rest,
    )
    if options.fine_tune_type == "full":
        path = os.path.join(adapter_path, "model")
        save_model_directory(path, options.model, trained["model"])
        if mx.distributed.init().rank() == 0:
            print(f"Saved the fine-tuned model to {path} (mlx_lm.load reads it)", flush=True)


def main(argv=None):
    """Run ``mlx_lm.lora`` with the sharded optimizer; see the module docstring."""
    from mlx_lm.lora import run

    from .lm.hooks import lora_loads_lazily, lora_tests_model, lora_train_replaced
    from .lm.sharding import check_options

    os.environ["TOKENIZERS_PARALLELISM"] = "true"  # as mlx_lm.lora sets it
    args = parse_args(argv)
    # Before the model loads: a refused combination fails at once.
    check_options(args.fsdp, bool(args.fully_shard), bool(args.reshard_after_forward))
    lazily = args.fully_shard and mx.distributed.init().size() > 1
    trained = {}
    with lora_train_replaced(partial(_train, args, trained)), lora_tests_model(trained), \
            lora_loads_lazily() if lazily else nullcontext():
        run(args)


if __name__ == "__main__":
    main()
