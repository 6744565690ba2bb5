#!/usr/bin/env python3
"""Convert an OLMoE checkpoint directory (as olmoe_shape.py writes it) to an F32 GGUF.

    PYTHONPATH=<llama.cpp>/gguf-py python olmoe_to_gguf.py CHECKPOINT_DIR OUT.gguf

Why not llama.cpp's own convert_hf_to_gguf.py: it imports torch and transformers at the top,
and PyPI's torch for Linux pulls in gigabytes of CUDA libraries. This writer needs only numpy
and llama.cpp's gguf-py (from the same source tree as the binaries, so metadata keys and tensor
names match the llama-bench that reads the file). It handles only what the `olmoe` architecture
needs: dense bf16/f32 safetensors, one file, a byte-level BPE tokenizer.json.
"""
import json
import struct
import sys
from pathlib import Path

import gguf
import numpy as np


def read_safetensors(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    out = {}
    for name, t in header.items():
        lo, hi = t["data_offsets"]
        raw = data[lo:hi]
        if t["dtype"] == "BF16":
            # bf16 is the top half of an f32, so widening is exact.
            arr = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
        elif t["dtype"] == "F32":
            arr = np.frombuffer(raw, "<f4")
        else:
            sys.exit(f"{name}: dtype {t['dtype']} not handled")
        out[name] = arr.reshape(t["shape"])
    return out


def main():
    ckpt, out = Path(sys.argv[1]), Path(sys.argv[2])
    cfg = json.loads((ckpt / "config.json").read_text())
    if cfg.get("model_type") != "olmoe":
        sys.exit(f"{ckpt}: model_type {cfg.get('model_type')!r}, expected 'olmoe'")
    # llama.cpp's olmoe graph sizes k_norm by hidden_size and applies the top-k weights
    # unnormalised, so other configurations would load but compute something else.
    if cfg["num_key_value_heads"] != cfg["num_attention_heads"] or cfg.get("norm_topk_prob"):
        sys.exit("llama.cpp's olmoe needs num_key_value_heads == num_attention_heads and norm_topk_prob false")
    n_layer, n_expert = cfg["num_hidden_layers"], cfg["num_experts"]
    rope = cfg.get("rope_parameters") or {}
    rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))

    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.OLMOE])
    w.add_name(ckpt.name)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_block_count(n_layer)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(n_expert)
    w.add_expert_used_count(cfg["num_experts_per_tok"])

    # Tokenizer as a GPT-2-style BPE; "qwen2" names the pre-tokeniser regex olmoe_shape.py uses.
    tok = json.loads((ckpt / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = tok["model"]["vocab"]
    if len(vocab) != cfg["vocab_size"] or sorted(vocab.values()) != list(range(len(vocab))):
        sys.exit(f"tokenizer vocabulary ({len(vocab)}) does not cover ids 0..{cfg['vocab_size'] - 1}")
    special = {a["id"] for a in tok.get("added_tokens", []) if a.get("special")}
    tokens = sorted(vocab, key=vocab.get)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))])
    # Merges, eos/pad ids and add_bos/add_eos flags from tokenizer.json + tokenizer_config.json.
    gguf.SpecialVocab(ckpt, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.OLMOE, n_layer)
    tensors = read_safetensors(ckpt / "model.safetensors")

    def add(hf_name, arr):
        name = names.get_name(hf_name, try_suffixes=(".weight",))
        if name is None:
            sys.exit(f"no llama.cpp name for {hf_name}")
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))

    for name in sorted(tensors):
        if ".mlp.experts." not in name:
            add(name, tensors.pop(name))
    # llama.cpp keeps each layer's experts as one 3-D tensor per projection: [expert, out, in].
    for i in range(n_layer):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            parts = [tensors.pop(f"model.layers.{i}.mlp.experts.{e}.{proj}.weight") for e in range(n_expert)]
            add(f"model.layers.{i}.mlp.experts.{proj}.weight", np.stack(parts))
    if tensors:
        sys.exit(f"tensors left unconverted: {sorted(tensors)[:5]}")

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
