#!/usr/bin/env python3
"""examples/moe/tools/make_peer_checkpoint.py — a random-weight Hugging Face checkpoint of
one of examples/moe/configs at reduced depth, for giving the SAME weights to ws_decode
(which loads HF checkpoints) and to llama.cpp (through gguf_none_vocab.py).

The model is built by hf_peer.build_model (transformers' own class of the config's
model_type, AutoConfig.for_model(...) with num_hidden_layers overridden, seeded random
init, bf16) and written with save_pretrained (safetensors, sharded, with its index).
No tokenizer is written (convert it with gguf_none_vocab.py).

  python3 examples/moe/tools/make_peer_checkpoint.py --model qwen3 --layers 4 --out /tmp/ckpt
  # a tiny one for CPU smoke tests (converts in seconds):
  python3 examples/moe/tools/make_peer_checkpoint.py --model qwen3 --layers 2 --out /tmp/tiny \\
      --set hidden_size=128 --set intermediate_size=256 --set moe_intermediate_size=64 \\
      --set num_experts=8 --set num_experts_per_tok=2 --set num_attention_heads=4 \\
      --set num_key_value_heads=2 --set head_dim=64 --set vocab_size=512 --set bos_token_id=1 --set eos_token_id=2
  (ws_decode takes head dims 64/128/256 and MLA 512/64 or 128/32: for a tiny dsv2lite add
  --set kv_lora_rank=128 --set qk_rope_head_dim=32)

--model: qwen3 (qwen3_30b_a3b.json), dsv2lite (deepseek_v2_lite.json), mixtral
(mixtral_8x7b.json), or --config PATH. --set KEY=VALUE overrides a config entry
(VALUE parsed as JSON, else kept as a string). --device auto builds on the GPU when
torch sees one (initialisation is much faster there), else on the CPU.

Prints one line of JSON on stdout (also written to --meta PATH if given): the
directory, its bytes, the routed-expert layout ws_decode and llama.cpp's -ot need
(moe_layers: the decoder layers with routed experts; num_experts per layer;
expert_bytes: one routed expert's gate+up+down bytes in bf16).
"""
import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hf_peer  # noqa: E402  (build_model; imports torch lazily)

CONFIGS = {
    "qwen3": "qwen3_30b_a3b.json",
    "dsv2lite": "deepseek_v2_lite.json",
    "mixtral": "mixtral_8x7b.json",
}


def parse_value(s):
    try:
        return json.loads(s)
    except ValueError:
        return s


def moe_layout(cfg):
    """(moe layer indices, routed experts per layer, moe intermediate size) as ws_decode counts them."""
    L = int(cfg["num_hidden_layers"])
    mt = cfg["model_type"]
    if mt == "qwen3_moe":
        E = int(cfg["num_experts"])
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        only = set(cfg.get("mlp_only_layers") or [])
        layers = [l for l in range(L) if l not in only and E > 0 and (l + 1) % step == 0]
        return layers, E, int(cfg["moe_intermediate_size"])
    if mt == "deepseek_v2":
        E = int(cfg["n_routed_experts"])
        k = int(cfg.get("first_k_dense_replace", 0) or 0)
        freq = int(cfg.get("moe_layer_freq", 1) or 1)
        layers = [l for l in range(L) if l >= k and l % freq == 0]
        return layers, E, int(cfg["moe_intermediate_size"])
    if mt == "mixtral":
        return list(range(L)), int(cfg["num_local_experts"]), int(cfg["intermediate_size"])
    raise ValueError("model_type %r not supported" % mt)


def dir_bytes(path):
    total, files = 0, 0
    for name in os.listdir(path):
        p = os.path.join(path, name)
        if os.path.isfile(p):
            total += os.path.getsize(p)
            files += 1
    return total, files


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--model", choices=sorted(CONFIGS))
    g.add_argument("--config", help="a config.json (instead of --model)")
    ap.add_argument("--layers", type=int, required=True, help="num_hidden_layers of the checkpoint")
    ap.add_argument("--out", required=True, help="output directory (created; must be empty or absent)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config entry")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda: where the weights are initialised")
    ap.add_argument("--max-shard-size", default="5GB")
    ap.add_argument("--meta", help="also write the JSON line to this file")
    a = ap.parse_args()
    t0 = time.time()

    cfg_path = a.config or os.path.join(HERE, "..", "configs", CONFIGS[a.model])
    with open(cfg_path) as f:
        cfg = json.load(f)
    for kv in a.set:
        if "=" not in kv:
            ap.error("--set wants KEY=VALUE, got %r" % kv)
        k, v = kv.split("=", 1)
        cfg[k] = parse_value(v)
    if a.layers < 1:
        ap.error("--layers must be >= 1")
    if cfg.get("model_type") == "qwen3_moe" and "max_window_layers" in cfg:
        cfg["max_window_layers"] = min(int(cfg["max_window_layers"]), a.layers)
    if os.path.isdir(a.out) and os.listdir(a.out):
        ap.error("--out %s exists and is not empty" % a.out)

    import torch
    import transformers

    dev = a.device
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    ns = SimpleNamespace(layers=a.layers, seed=a.seed, attn_implementation="eager")
    model, config, cls_name = hf_peer.build_model(torch, transformers, ns, cfg, dev)
    t_built = time.time()
    os.makedirs(a.out, exist_ok=True)
    model.save_pretrained(a.out, max_shard_size=a.max_shard_size)
    t_saved = time.time()
    del model
    nbytes, nfiles = dir_bytes(a.out)

    saved = dict(cfg)
    saved["num_hidden_layers"] = a.layers
    layers, E, I = moe_layout(saved)
    H = int(saved["hidden_size"])
    meta = {
        "dir": os.path.abspath(a.out),
        "config": os.path.abspath(cfg_path),
        "model_type": saved["model_type"],
        "class": cls_name,
        "layers": a.layers,
        "overrides": a.set,
        "seed": a.seed,
        "bytes": nbytes,
        "files": nfiles,
        "moe_layers": layers,
        "num_experts": E,
        "expert_bytes": 3 * H * I * 2,
        "routed_expert_bytes": 3 * H * I * 2 * E * len(layers),
        "device": dev,
        "build_seconds": round(t_built - t0, 2),
        "save_seconds": round(t_saved - t_built, 2),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    line = json.dumps(meta)
    if a.meta:
        with open(a.meta, "w") as f:
            f.write(line + "\n")
    sys.stderr.write("make_peer_checkpoint: %s %d layers -> %s: %.3f GiB in %d files (%.1f s)\n"
                     % (cls_name, a.layers, a.out, nbytes / 2**30, nfiles, t_saved - t0))
    print(line)


if __name__ == "__main__":
    main()
