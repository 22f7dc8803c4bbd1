#!/usr/bin/env python3
"""examples/moe/tools/gguf_none_vocab.py — llama.cpp's convert_hf_to_gguf.py for a
tokenizer-less (random-weight) checkpoint: the converter's model class for the
checkpoint's architecture gets a set_vocab that writes tokenizer model "none" and the
config's vocab_size (llama.cpp loads such a GGUF and benchmarks it), then the
converter runs unchanged through runpy, with the snapshot's root and its gguf-py on
sys.path. Nothing of llama.cpp is copied here: --llama-cpp points at an unpacked
source tree of llama.cpp (e.g. unpacked from .peers/llama.cpp-src.tgz, an ignored folder).

  python3 examples/moe/tools/gguf_none_vocab.py --llama-cpp build-peers/llama.cpp \\
      CKPT_DIR --outtype bf16 --outfile model.gguf

Every argument after the wrapper's own (--llama-cpp) goes to convert_hf_to_gguf.py.
Architectures (config.json "architectures"[0] -> the snapshot's converter class):
  Qwen3MoeForCausalLM    -> conversion.qwen.Qwen3MoeModel
  DeepseekV2ForCausalLM  -> conversion.deepseek.DeepseekV2Model
  MixtralForCausalLM     -> conversion.llama.LlamaModel
DeepSeek-V2 without q LoRA (V2-Lite) also gets attention.q_lora_rank = 0: llama.cpp
recognises V2-Lite by its 27 (or 26) layers and otherwise requires that key.
"""
import argparse
import json
import os
import runpy
import sys

SUPPORTED = {
    "Qwen3MoeForCausalLM": ("conversion.qwen", "Qwen3MoeModel"),
    "DeepseekV2ForCausalLM": ("conversion.deepseek", "DeepseekV2Model"),
    "MixtralForCausalLM": ("conversion.llama", "LlamaModel"),
}


def main():
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--llama-cpp", default=os.environ.get("LLAMA_CPP_SRC"),
                    help="unpacked llama.cpp snapshot (default: $LLAMA_CPP_SRC)")
    ap.add_argument("-h", "--help", action="store_true")
    a, rest = ap.parse_known_args()
    if a.help or not a.llama_cpp:
        sys.stdout.write(__doc__)
        sys.exit(0 if a.help else 2)
    src = os.path.abspath(a.llama_cpp)
    script = os.path.join(src, "convert_hf_to_gguf.py")
    if not os.path.isfile(script):
        sys.exit("gguf_none_vocab: %s not found" % script)
    ckpt = next((r for r in rest if not r.startswith("-") and os.path.isdir(r)), None)
    if ckpt is None:
        sys.exit("gguf_none_vocab: no checkpoint directory among the converter's arguments %r" % rest)
    with open(os.path.join(ckpt, "config.json")) as f:
        hp = json.load(f)
    arch = (hp.get("architectures") or [None])[0]
    if arch not in SUPPORTED:
        sys.exit("gguf_none_vocab: architecture %r is not one of %s" % (arch, ", ".join(SUPPORTED)))
    vocab_size = int(hp["vocab_size"])

    sys.path.insert(0, src)
    sys.path.insert(1, os.path.join(src, "gguf-py"))
    import importlib

    import conversion  # the snapshot's package (the converter imports the same module object)

    mod_name, cls_name = SUPPORTED[arch]
    cls = getattr(importlib.import_module(mod_name), cls_name)
    registered = conversion.get_model_class(arch)
    if not issubclass(registered, cls):
        sys.exit("gguf_none_vocab: the snapshot maps %s to %s, not %s.%s" % (arch, registered.__name__, mod_name, cls_name))

    def set_vocab_none(self):
        self.gguf_writer.add_tokenizer_model("none")
        self.gguf_writer.add_vocab_size(int(self.hparams.get("vocab_size", vocab_size)))
        if arch == "DeepseekV2ForCausalLM" and self.hparams.get("q_lora_rank") is None:
            # llama.cpp tells V2-Lite (no q LoRA) by its layer count (27 or 26) and otherwise
            # requires the key: at reduced depth, say "no q LoRA" explicitly (0 = plain q_proj)
            self.gguf_writer.add_q_lora_rank(0)

    registered.set_vocab = set_vocab_none  # the class the converter will instantiate
    sys.stderr.write("gguf_none_vocab: %s -> %s.set_vocab = tokenizer 'none', vocab %d\n"
                     % (arch, registered.__name__, vocab_size))
    sys.argv = [script] + rest
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
