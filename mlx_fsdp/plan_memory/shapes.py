"""What the planner plans for: the paths, shapes and dtypes of a model's arrays.

Three sources, none of which loads a weight:

* a safetensors file: its JSON header lists every array's dtype and shape;
* an mlx-lm / Hugging Face model directory: the headers of all its
  ``*.safetensors`` files, or, where it has none, the Llama-style shapes its
  ``config.json`` describes;
* a shape description of a Llama-style model (:func:`llama`), by preset
  (``7B``) and/or by dimensions.
"""

import glob
import json
import os
from dataclasses import dataclass, replace
from typing import Optional, Tuple

from ..checkpoint.manifest import read_header


@dataclass(frozen=True)
class Array:
    """One array of the model.

    Attributes:
        path (str): Its path, as ``mlx.utils.tree_flatten`` names it.
        shape (tuple): Its shape.
        dtype (str): Its MLX dtype name, e.g. ``"bfloat16"``.
        frozen (bool): Whether it is left out of training (a LoRA base).
            Default: ``False``.
        transposed (bool, optional): Whether its gradient arrives as a
            transposed view, as MLX returns a ``Linear`` weight's (``False``:
            row-major, as an embedding's or a LoRA factor's), where that is
            known; it decides what packing the gradient copies
            (:class:`~mlx_fsdp.plan_memory.sharding.BucketBytes`).
            Default: ``None`` (unknown: counted as copied either way).
    """

    path: str
    shape: Tuple[int, ...]
    dtype: str
    frozen: bool = False
    transposed: Optional[bool] = None


@dataclass(frozen=True)
class Model:
    """A model as the planner sees it.

    Attributes:
        name (str): What to call it in the output.
        arrays (tuple[Array]): Every array, in a fixed order.
        heads (int, optional): Attention heads, where known (a description or
            a ``config.json``), for the activations. Default: ``None``.
    """

    name: str
    arrays: Tuple[Array, ...]
    heads: Optional[int] = None

    @property
    def num_parameters(self) -> int:
        """Elements in all arrays."""
        total = 0
        for a in self.arrays:
            size = 1
            for d in a.shape:
                size *= d
            total += size
        return total


#: Llama-style presets (the published shapes of Llama 2 and Llama 3 8B):
#: layers, dims, ffn, vocab, heads, kv_heads.
PRESETS = {
    "7B": dict(layers=32, dims=4096, ffn=11008, vocab=32000, heads=32, kv_heads=32),
    "13B": dict(layers=40, dims=5120, ffn=13824, vocab=32000, heads=40, kv_heads=40),
    "70B": dict(layers=80, dims=8192, ffn=28672, vocab=32000, heads=64, kv_heads=8),
    "8B": dict(layers=32, dims=4096, ffn=14336, vocab=128256, heads=32, kv_heads=8),
}


def llama(layers: int, dims: int, ffn: int, vocab: int, heads: int,
          kv_heads: Optional[int] = None, tie: bool = False, dtype: str = "bfloat16",
          name: Optional[str] = None) -> Model:
    """The arrays of a Llama-style decoder, with mlx-lm's paths.

    Per layer: ``q_proj`` ``(dims, dims)``, ``k_proj`` and ``v_proj``
    ``(kv_heads * dims / heads, dims)``, ``o_proj`` ``(dims, dims)``,
    ``gate_proj`` and ``up_proj`` ``(ffn, dims)``, ``down_proj`` ``(dims,
    ffn)``, two RMS norms ``(dims,)``; no biases. Then the embedding ``(vocab,
    dims)``, a final norm ``(dims,)`` and, unless ``tie``, the output head
    ``(vocab, dims)``. Llama 2 7B's shapes give 6,738,415,616 parameters.

    Args:
        layers (int): Decoder layers.
        dims (int): Model width.
        ffn (int): Width of the MLP's hidden layer.
        vocab (int): Vocabulary size.
        heads (int): Attention heads; must divide ``dims``.
        kv_heads (int, optional): Key/value heads (grouped-query attention).
            Default: ``heads``.
        tie (bool): Share the embedding with the output head. Default: ``False``.
        dtype (str): The parameters' dtype. Default: ``"bfloat16"``.
        name (str, optional): What to call the model. Default: its dimensions.

    Returns:
        Model: The arrays.
    """
    kv_heads = heads if kv_heads is None else kv_heads
    for key, value in dict(layers=layers, dims=dims, ffn=ffn, vocab=vocab, heads=heads,
                           kv_heads=kv_heads).items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}={value!r} must be a positive integer.")
    if dims % heads or heads % kv_heads:
        raise ValueError(
            f"heads={heads} must divide dims={dims}, and kv_heads={kv_heads} must "
            "divide heads; pass --heads and --kv-heads that do."
        )
    kv = kv_heads * (dims // heads)
    per_layer = [
        ("self_attn.q_proj.weight", (dims, dims)),
        ("self_attn.k_proj.weight", (kv, dims)),
        ("self_attn.v_proj.weight", (kv, dims)),
        ("self_attn.o_proj.weight", (dims, dims)),
        ("mlp.gate_proj.weight", (ffn, dims)),
        ("mlp.up_proj.weight", (ffn, dims)),
        ("mlp.down_proj.weight", (dims, ffn)),
        ("input_layernorm.weight", (dims,)),
        ("post_attention_layernorm.weight", (dims,)),
    ]
    # Every matrix but the embedding is a Linear weight (tied, the embedding's
    # gradient is its lookup's and its product's summed: row-major).
    arrays = [Array("model.embed_tokens.weight", (vocab, dims), dtype, transposed=False)]
    for i in range(layers):
        arrays += [Array(f"model.layers.{i}.{p}", s, dtype, transposed=len(s) == 2 or None)
                   for p, s in per_layer]
    arrays.append(Array("model.norm.weight", (dims,), dtype))
    if not tie:
        arrays.append(Array("lm_head.weight", (vocab, dims), dtype, transposed=True))
    if name is None:
        name = (f"Llama-style, {layers} layers, dims {dims}, ffn {ffn}, vocab {vocab}, "
                f"{heads} heads" + (f" ({kv_heads} kv)" if kv_heads != heads else ""))
    return Model(name, tuple(arrays), heads)


def from_safetensors(*paths: str, name: Optional[str] = None) -> Model:
    """The arrays listed in the headers of safetensors files (no weight is read).

    Args:
        *paths (str): The files.
        name (str, optional): What to call the model. Default: the first file.

    Returns:
        Model: The arrays, file by file, in header order.
    """
    arrays = []
    for path in paths:
        for key, entry in read_header(path).items():
            arrays.append(Array(key, tuple(entry["shape"]), entry["dtype"]))
    if not arrays:
        raise ValueError(f"{', '.join(paths)} hold no arrays; pass the model's weights.")
    return Model(name or os.path.basename(paths[0]), tuple(arrays))


_DTYPE_OF_CONFIG = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


def from_config(config: dict, name: str) -> Model:
    """The Llama-style arrays a Hugging Face / mlx-lm ``config.json`` describes.

    Reads ``num_hidden_layers``, ``hidden_size``, ``intermediate_size``,
    ``vocab_size``, ``num_attention_heads``, ``num_key_value_heads``,
    ``tie_word_embeddings`` and ``torch_dtype`` (bfloat16 if absent).
    """
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size",
            "num_attention_heads")
    missing = [k for k in keys if k not in config]
    if missing:
        raise ValueError(
            f"config.json of {name} lacks {', '.join(missing)}, so its shapes cannot "
            "be derived; put the model's *.safetensors next to it, or describe it "
            "with --layers/--dims/--ffn/--vocab/--heads."
        )
    return llama(
        config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"],
        config["vocab_size"], config["num_attention_heads"],
        config.get("num_key_value_heads"), bool(config.get("tie_word_embeddings", False)),
        _DTYPE_OF_CONFIG.get(config.get("torch_dtype"), "bfloat16"), name,
    )


def _gradient_kinds(path: str) -> dict:
    """``{path: Array.transposed}`` of the model mlx-lm loads from directory ``path``
    (lazily: no weight is read), or ``{}`` where mlx-lm is missing or cannot load it;
    the planner then counts every matrix's gradient as copied when packed."""
    try:
        from pathlib import Path

        from mlx_lm.utils import load_model

        module, _ = load_model(Path(path), lazy=True)
    except Exception:  # no mlx-lm, or an architecture it lacks: unknown, the safe count
        return {}
    return {a.path: a.transposed for a in from_tree(module).arrays}


def from_directory(path: str) -> Model:
    """A model directory: its safetensors headers, or else its ``config.json``."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    name = os.path.basename(os.path.normpath(path))
    config = os.path.join(path, "config.json")
    if files:
        heads, kinds = None, {}
        if os.path.exists(config):
            with open(config) as f:
                described = json.load(f)
            heads, kinds = described.get("num_attention_heads"), _gradient_kinds(path)
        arrays = from_safetensors(*files, name=name).arrays
        return Model(name, tuple(replace(a, transposed=kinds.get(a.path)) for a in arrays), heads)
    if not os.path.exists(config):
        raise ValueError(
            f"{path} holds neither *.safetensors nor config.json; pass an mlx-lm "
            "model directory, a .safetensors file, or a shape description (--params 7B)."
        )
    with open(config) as f:
        return from_config(json.load(f), name)


def load(source: str) -> Model:
    """A model from a directory or a ``.safetensors`` file."""
    if os.path.isdir(source):
        return from_directory(source)
    if os.path.isfile(source):
        return from_safetensors(source)
    raise ValueError(
        f"model={source!r} is neither a directory nor a file; pass an mlx-lm model "
        "directory, a .safetensors file, or a shape description (--params 7B)."
    )


def from_tree(parameters, name: str = "model") -> Model:
    """The arrays of a parameter tree (``model.trainable_parameters()``), by shape only.

    Given the module itself (an ``mlx.nn.Module``), its trainable arrays, each
    with how its gradient arrives (:attr:`Array.transposed`): a ``Linear``
    weight's transposed, an ``Embedding``'s row-major.
    """
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    kinds = {}
    if isinstance(parameters, nn.Module):
        for prefix, module in parameters.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                kinds[f"{prefix}.weight" if prefix else "weight"] = isinstance(module, nn.Linear)
        parameters = parameters.trainable_parameters()
    return Model(name, tuple(
        Array(path, tuple(a.shape), str(a.dtype).rsplit(".", 1)[-1], transposed=kinds.get(path))
        for path, a in tree_flatten(parameters)
    ))
