# SPDX-License-Identifier: Apache-2.0
"""The example (python/examples/generate.py) and the benchmark (python/bench/bench_generate.py)
run end to end on a tiny local checkpoint with its own tokenizer and chat template."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_model

PY = Path(__file__).resolve().parents[1]
WORDS = ["<unk>", "<pad>", "<eos>"] + [f"w{i}" for i in range(253)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("tiny-qwen3-moe")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w1{% endif %}"
    fast.save_pretrained(d)
    model = tiny_model("qwen3_moe", eos_token_id=2, pad_token_id=1)
    model.save_pretrained(d)
    return d


def run(args):
    p = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return p.stdout


def test_example_generate_prints_text_rate_and_split(checkpoint):
    out = run([PY / "examples" / "generate.py", checkpoint, "--prompt", "w5 w6 w7 " * 12, "--prompt", "w9 w10",
               "--max-new-tokens", "40", "--policy", "0.5", "--dtype", "fp32", "--block-tokens", "16",
               "--d-window", "32", "--cpu-threads", "1", "--device", "cpu"])
    assert out.count("--- prompt") == 2
    assert "tok/s" in out and "split:" in out and "policy 0.5 target 0.500" in out


def test_bench_writes_json_and_table(checkpoint, tmp_path):
    js = tmp_path / "bench.json"
    out = run([PY / "bench" / "bench_generate.py", "--config", checkpoint, "--batch", "2", "--context", "64",
               "--new-tokens", "8", "--dtype", "bf16", "--caches", "writescope,dynamic", "--policies",
               "roofline,0.5,learned", "--block-tokens", "16", "--d-window", "32", "--cpu-threads", "1", "--json", js])
    doc = json.loads(js.read_text())
    names = [r["cache"] for r in doc["results"]]
    assert names == ["writescope:roofline", "writescope:0.5", "writescope:learned", "DynamicCache"]
    assert all(r["decode_steps"] == 7 for r in doc["results"])
    assert doc["results"][1]["split"]["cpu_share"] == 0.5
    assert "decode tok/s" in out and "writescope:0.5" in out
    # the learned run starts from the roofline run's learned costs (no warm-up of its own)
    learned = doc["results"][0]["learned_calibration"]
    assert learned["cpu_cost_per_token_seconds"] > 0 and learned["gpu_cost_per_token_seconds"] > 0
    assert "writescope:learned" not in [w["cache"] for w in doc["warmup"]]
    assert "writescope:learned" in doc["ratios"]
    bad = subprocess.run([sys.executable, PY / "bench" / "bench_generate.py", "--config", str(checkpoint),
                          "--policies", "learned,roofline"], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "learned needs a roofline run before it" in bad.stderr


def test_bench_random_weights_from_config_json_and_summary(tmp_path):
    """--config takes an HF config .json with --random-weights; --summarize tabulates the JSONs;
    a context beyond max_position_embeddings is refused."""
    from conftest import tiny_config

    cfg = tmp_path / "tiny.json"
    tiny_config("mixtral", num_hidden_layers=3, max_position_embeddings=128).to_json_file(cfg)
    js = tmp_path / "bench.json"
    common = ["--config", cfg, "--random-weights", "--layers", "1", "--batch", "2", "--new-tokens", "4",
              "--caches", "writescope,offloaded,dynamic", "--policies", "0.5", "--block-tokens", "16",
              "--d-window", "32", "--cpu-threads", "1", "--warmup-context", "16", "--device", "cpu"]
    prof = tmp_path / "prefill_profile.txt"
    out = run([PY / "bench" / "bench_generate.py", *common, "--context", "96", "--json", js, "--profile-prefill", prof])
    doc = json.loads(js.read_text())
    text = prof.read_text()  # one section per cache that ran, each with the profiler's operator table
    assert text.count("==== ") == 2 and "==== writescope:0.5: prefill of 2 x 96 tokens" in text
    assert "Self CPU" in text and "failed" not in text
    assert doc["layers"] == 1 and doc["model"] == "MixtralForCausalLM" and doc["complete"]
    assert [w["cache"] for w in doc["warmup"]] == ["writescope:0.5", "DynamicCache"]
    assert [r["cache"] for r in doc["results"]] == ["writescope:0.5", "DynamicCache(offloading=True)", "DynamicCache"]
    q = doc["ratios"]["writescope:0.5"]
    ws, dyn = doc["results"][0], doc["results"][2]
    assert q["prefill_x_dynamic"] == ws["prefill_tok_s"] / dyn["prefill_tok_s"]
    assert q["decode_x_offloaded"] is None and 0 < q["python_overhead_share"] < 1
    assert "prefill x DynamicCache" in out
    table = run([PY / "bench" / "bench_generate.py", "--summarize", js])
    assert "MixtralForCausalLM" in table and "writescope:0.5" in table and "offloading needs a CUDA device" in table
    p = subprocess.run([sys.executable, PY / "bench" / "bench_generate.py", *map(str, common), "--context", "125"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 2 and "exceeds the config's max_position_embeddings 128" in p.stderr


def test_bench_device_gaps_measures_idle_time_between_device_events():
    """bench_generate.device_gaps on a made-up profile: the busy time is the union of the device
    intervals (overlaps counted once), the gaps are listed longest first with the host operators
    that ran during them."""
    import importlib.util
    import types

    from torch.autograd import DeviceType

    spec = importlib.util.spec_from_file_location("bench_generate", PY / "bench" / "bench_generate.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def ev(start, end, name, device):
        return types.SimpleNamespace(time_range=types.SimpleNamespace(start=start, end=end), name=name,
                                     device_type=device)

    cuda, cpu = DeviceType.CUDA, DeviceType.CPU
    prof = types.SimpleNamespace(events=lambda: [
        ev(0, 100, "k1", cuda), ev(50, 150, "k2", cuda),     # overlapping: busy 0..150
        ev(60, 70, "k1b", cuda),                             # inside the busy interval: changes nothing
        ev(400, 500, "k3", cuda), ev(520, 600, "k4", cuda),  # gaps 150..400 (250 us) and 500..520 (20 us)
        ev(160, 390, "writescope::append_prefill_batch", cpu), ev(0, 600, "aten::mm", cpu)])
    text = bench.device_gaps(prof)
    lines = text.splitlines()
    assert lines[0] == "device busy 0.3 ms of a 0.6 ms span (0.550); idle 0.3 ms in 2 gaps"
    assert "writescope::append_prefill_batch 0.2 ms" in lines[1] and "aten::mm" not in lines[1]
    assert lines[2].startswith("  gap     0.25 ms after 'k2' before 'k3'; host: writescope::append_prefill_batch")
    assert lines[3] == "  gap     0.02 ms after 'k3' before 'k4'; host: "
    assert bench.device_gaps(types.SimpleNamespace(events=lambda: [ev(0, 1, "x", cpu)])) == "device: no device events"
