"""Small random-weight language models and data, built offline.

For trying ``python -m mlx_fsdp.lora`` without downloading anything, and for
the tests and ``benchmarks/bench_lm.py``: a model directory that
``mlx_lm.load`` opens (``config.json``, ``model.safetensors``, a word-level
``tokenizer.json``) and a data directory of ``{"text": ...}`` lines.

    python -m mlx_fsdp.lm.tiny OUT            # OUT/model (Llama) and OUT/data
"""

import argparse
import json
import os
import random

import mlx.core as mx

#: The words of the tokenizer's vocabulary and of the generated text.
WORDS = tuple((
    "the a one two three red green blue small large cat dog bird fish tree house river "
    "stone cloud road city field light dark fast slow old new warm cold runs sees finds "
    "holds sings jumps sleeps walks reads writes and or but with under over near far "
    "up down here there today night morning evening song story book door window table "
    "chair garden hill lake sea ship train car wheel bell clock"
).split())

#: Special tokens, first in the vocabulary.
SPECIAL = ("<unk>", "<pad>", "<s>", "</s>")

#: Architectures :func:`write_model` knows.
MODEL_TYPES = ("llama", "qwen3")


def _config(model_type: str, hidden_size: int, layers: int, vocab_size: int) -> dict:
    heads = max(1, hidden_size // 16)
    config = {
        "model_type": model_type,
        "hidden_size": hidden_size,
        "num_hidden_layers": layers,
        "intermediate_size": 2 * hidden_size,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": hidden_size // heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "tie_word_embeddings": model_type == "qwen3",
        "bos_token_id": SPECIAL.index("<s>"),
        "eos_token_id": SPECIAL.index("</s>"),
    }
    return config


def write_tokenizer(path: str):
    """Write a word-level tokenizer over :data:`WORDS` that ``mlx_lm.load`` loads.

    Args:
        path (str): The model directory; gets ``tokenizer.json`` and
            ``tokenizer_config.json``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", pad_token="<pad>",
        bos_token="<s>", eos_token="</s>",
    )
    fast.save_pretrained(path)


def write_model(path: str, *, model_type: str = "llama", hidden_size: int = 32,
                layers: int = 2, seed: int = 0, quantize_bits: int = 0,
                group_size: int = 32, dtype: str = "float32"):
    """Write a random-weight model directory that ``mlx_lm.load`` opens.

    Built with mlx-lm's own classes and save functions; nothing is downloaded.

    Args:
        path (str): The directory to create.
        model_type (str): ``"llama"`` or ``"qwen3"``. Default: ``"llama"``.
        hidden_size (int): Model width (a multiple of 16). Default: ``32``.
        layers (int): Number of transformer blocks. Default: ``2``.
        seed (int): Seed of the random weights. Default: ``0``.
        quantize_bits (int): Quantize the weights to this many bits with
            ``mlx_lm``'s quantization (``0``: keep them as they are). Default: ``0``.
        group_size (int): Quantization group size; must divide ``hidden_size``.
            Default: ``32``.
        dtype (str): Parameter dtype, e.g. ``"bfloat16"``. Default: ``"float32"``.
    """
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model
    from pathlib import Path

    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r} is not one of {MODEL_TYPES}.")
    if hidden_size < 16 or hidden_size % 16:
        raise ValueError(f"hidden_size={hidden_size} must be a positive multiple of 16.")
    os.makedirs(path, exist_ok=True)
    config = _config(model_type, hidden_size, layers, len(SPECIAL) + len(WORDS))
    save_config(dict(config), os.path.join(path, "config.json"))
    mx.random.seed(seed)
    # No weight files yet: strict=False builds the model with its random initialization.
    model, config = load_model(Path(path), strict=False)
    model.set_dtype(getattr(mx, dtype))
    if quantize_bits:
        model, config = quantize_model(model, config, group_size, quantize_bits)
    mx.eval(model.parameters())
    save_model(path, model)
    save_config(config, os.path.join(path, "config.json"))
    write_tokenizer(path)


def write_data(path: str, *, train: int = 64, valid: int = 16, test: int = 8,
               words_per_line: int = 12, seed: int = 0):
    """Write ``train.jsonl``, ``valid.jsonl`` and ``test.jsonl`` of ``{"text": ...}`` lines.

    A split of 0 lines is not written (mlx-lm refuses an empty file).

    Every line has the same number of words, so every rank of a batch gets the
    same number of tokens and the loss does not depend on the number of ranks.

    Args:
        path (str): The directory to create.
        train (int): Training lines. Default: ``64``.
        valid (int): Validation lines. Default: ``16``.
        test (int): Test lines. Default: ``8``.
        words_per_line (int): Words in every line. Default: ``12``.
        seed (int): Seed of the text. Default: ``0``.
    """
    rng = random.Random(seed)
    os.makedirs(path, exist_ok=True)
    # A loose grammar gives the model something to learn in a few steps.
    nouns, verbs = WORDS[10:22], WORDS[30:38]
    for name, count in (("train", train), ("valid", valid), ("test", test)):
        if not count:
            continue
        with open(os.path.join(path, f"{name}.jsonl"), "w") as fh:
            for _ in range(count):
                words = []
                while len(words) < words_per_line:
                    words += ["the", rng.choice(nouns), rng.choice(verbs), rng.choice(WORDS)]
                fh.write(json.dumps({"text": " ".join(words[:words_per_line])}) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="Directory; gets model/ and data/.")
    parser.add_argument("--model-type", choices=MODEL_TYPES, default="llama")
    parser.add_argument("--hidden-size", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--quantize-bits", type=int, default=0)
    args = parser.parse_args(argv)
    model = os.path.join(args.out, "model")
    write_model(model, model_type=args.model_type, hidden_size=args.hidden_size,
                layers=args.layers, quantize_bits=args.quantize_bits)
    write_data(os.path.join(args.out, "data"))
    print(f"wrote {model} and {os.path.join(args.out, 'data')}")


if __name__ == "__main__":
    main()
