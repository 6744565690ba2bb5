#!/usr/bin/env python3
"""Write a random-weight OLMoE checkpoint (Hugging Face layout) for engine-vs-engine benchmarks.

    python3 bench/peers/olmoe_shape.py --out /tmp/olmoe-13m

The shape (6 layers, 32 experts of width 64, top-4, hidden 256, vocab 4096: 13.2 M parameters)
is small enough that a 2-core machine benchmarks it in seconds, while keeping OLMoE's structure
(q/k norms over the full projection width, untied head, unnormalised top-k), so dynmoe and
llama.cpp both do the same kinds of work as on the real model. Weights are N(0, 0.02)
from a fixed seed; throughput does not depend on their values, only reproducibility does.

Needs numpy and tokenizers; when they are missing the script re-runs itself in the venv under
bench/peers/.cache/venv (created on first use) rather than installing anything system-wide.
The safetensors file is written by hand so the `safetensors` package (and torch) are not needed.
"""
import argparse
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
VENV = HERE / ".cache" / "venv"

SHAPE = dict(layers=6, experts=32, expert_ff=64, top_k=4, hidden=256, heads=4, kv_heads=4, vocab=4096)
# Same special tokens and pre-tokenisation (Qwen2's regex) as the fixtures' tokenizers
# (tools/fixtures/train.py), so the checkpoint looks like the project's own.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def ensure_deps():
    try:
        import numpy  # noqa: F401
        import tokenizers  # noqa: F401
        return
    except ImportError:
        pass
    py = VENV / "bin" / "python"
    if Path(sys.prefix).resolve() == VENV.resolve():
        sys.exit("numpy/tokenizers still missing inside the venv; delete it and retry")
    if not py.exists():
        print(f"olmoe_shape: creating venv {VENV}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "numpy", "tokenizers"], check=True)
    os.execv(str(py), [str(py), __file__, *sys.argv[1:]])


def tensor_shapes(s):
    h, hd = s["hidden"], s["hidden"] // s["heads"]
    kv = s["kv_heads"] * hd
    shapes = {
        "model.embed_tokens.weight": [s["vocab"], h],
        "model.norm.weight": [h],
        "lm_head.weight": [s["vocab"], h],
    }
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": [h],
            p + "post_attention_layernorm.weight": [h],
            p + "self_attn.q_proj.weight": [h, h],
            p + "self_attn.k_proj.weight": [kv, h],
            p + "self_attn.v_proj.weight": [kv, h],
            p + "self_attn.o_proj.weight": [h, h],
            p + "self_attn.q_norm.weight": [h],
            p + "self_attn.k_norm.weight": [kv],
            p + "mlp.gate.weight": [s["experts"], h],
        })
        for e in range(s["experts"]):
            q = f"{p}mlp.experts.{e}."
            shapes[q + "gate_proj.weight"] = [s["expert_ff"], h]
            shapes[q + "up_proj.weight"] = [s["expert_ff"], h]
            shapes[q + "down_proj.weight"] = [h, s["expert_ff"]]
    return shapes


def to_bf16_bytes(x):
    import numpy as np

    # Round to nearest even, as torch's float32 -> bfloat16 cast does.
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype("<u2").tobytes()


def write_safetensors(path, shapes, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    names = sorted(shapes)
    blobs, header, offset = [], {"__metadata__": {"format": "pt"}}, 0
    for name in names:
        shape = shapes[name]
        # Norm weights are 1 (RMSNorm's initial value); everything else is a Gaussian.
        data = np.ones(shape, np.float32) if name.endswith("norm.weight") else rng.normal(0.0, 0.02, shape)
        blob = to_bf16_bytes(data)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # keep the data 8-byte aligned, as the safetensors library does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for blob in blobs:
            f.write(blob)


def config(s):
    return {
        "architectures": ["OlmoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "clip_qkv": None,
        "dtype": "bfloat16",
        "eos_token_id": 0,
        "hidden_act": "silu",
        "hidden_size": s["hidden"],
        "initializer_range": 0.02,
        "intermediate_size": s["expert_ff"],
        "max_position_embeddings": 4096,
        "model_type": "olmoe",
        "norm_topk_prob": False,
        "num_attention_heads": s["heads"],
        "num_experts": s["experts"],
        "num_experts_per_tok": s["top_k"],
        "num_hidden_layers": s["layers"],
        "num_key_value_heads": s["kv_heads"],
        "output_router_logits": False,
        "pad_token_id": None,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "router_aux_loss_coef": 0.01,
        "tie_word_embeddings": False,
        "transformers_version": "5.17.0",
        "use_cache": True,
        "vocab_size": s["vocab"],
    }


def train_tokenizer(vocab_size):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    byte_level = dict(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(**byte_level),
    ])
    tok.decoder = decoders.ByteLevel(**byte_level)
    tok.post_processor = processors.ByteLevel(**byte_level)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = (REPO / "data" / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")
    tok.train_from_iterator((text[i:i + 65536] for i in range(0, len(text), 65536)), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        sys.exit(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    spec = json.loads(tok.to_str())
    # tokenizers serialises the decoder with default options whatever it was given.
    spec["decoder"] = {"type": "ByteLevel", **byte_level}
    return spec


def tokenizer_config():
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": SPECIAL_TOKENS[0],
        "pad_token": SPECIAL_TOKENS[0],
        "unk_token": None,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def dump(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="checkpoint directory to write")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    ensure_deps()

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    shapes = tensor_shapes(SHAPE)
    write_safetensors(out / "model.safetensors", shapes, args.seed)
    dump(out / "config.json", config(SHAPE))
    dump(out / "generation_config.json", {"eos_token_id": 0, "pad_token_id": 0, "transformers_version": "5.17.0"})
    dump(out / "tokenizer.json", train_tokenizer(SHAPE["vocab"]))
    dump(out / "tokenizer_config.json", tokenizer_config())

    total = sum(math.prod(s) for s in shapes.values())
    per_expert = 3 * SHAPE["expert_ff"] * SHAPE["hidden"]
    # Counted as `dynmoe inspect` does: the embedding is a lookup, not compute.
    active = total - SHAPE["vocab"] * SHAPE["hidden"] - SHAPE["layers"] * (SHAPE["experts"] - SHAPE["top_k"]) * per_expert
    print(f"olmoe_shape: wrote {out}: {len(shapes)} tensors, {total:,} parameters ({active:,} active per token)")


if __name__ == "__main__":
    main()
