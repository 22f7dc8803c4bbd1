#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""examples/moe/tools/prefill_bounds.py on a synthetic summary whose bounds are
worked out by hand (rates of 1 TFLOP/s and 1 GB/s make every bound its work),
on a real ws_decode --json summary when one is given, and its refusals."""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(HERE, "..", "tools", "prefill_bounds.py")
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
import prefill_bounds  # noqa: E402

summary = {
    "layers": 2,
    "prefill_seconds": 9.0,
    "prefill_work": {"attention_flops": 2e12, "projection_flops": 1e12, "router_flops": 0.5e12,
                     "routed_expert_flops": 4e12, "shared_dense_flops": 0.5e12, "lm_head_flops": 0.0,
                     "total_flops": 8e12, "routed_rows": 100, "token_bytes_per_layer": 1000},
    "prefill_phases_seconds": {"attention": 4.0, "moe": 5.0, "moe_streamed_experts": 2.0, "kv_write_host": 0.5},
    "placement": {"prefill_routed_rows": 100, "prefill_device_rows": 75},
    "expert_streaming": {"bytes": 3e9},
    "sequences": [{"placed_tokens": 100000}, {"placed_tokens": 50000}],
}
rows = {p: (m, b) for p, m, b, _ in prefill_bounds.bounds(summary, 1.0, 2.0, 1.0, 1.0)}
ok = True


def check(what, got, want):
    global ok
    if abs(got - want) > 1e-9 * max(1.0, abs(want)):
        print("FAIL %s: %r, want %r" % (what, got, want))
        ok = False


check("attention bound", rows["attention + projections"][1], 2e12 / 2e12 + 1e12 / 1e12)  # 2 s
check("attention measured", rows["attention + projections"][0], 4.0)
check("moe bound", rows["MoE on the device"][1], (0.5e12 + 0.5e12 + 0.75 * 4e12) / 1e12)  # 4 s
check("moe measured (streamed part taken out)", rows["MoE on the device"][0], 3.0)
check("streamed bound = max(3 GB at 1 GB/s, 1 TFLOP at 1)", rows["streamed experts"][1], 3.0)
check("kv bound: 150000 tokens x 2 layers x 1000 B at 1 GB/s", rows["KV write-out (host, overlapped)"][1], 0.3)
check("whole bound = max(2 + 4 + 1, 3)", rows["whole prefill"][1], 7.0)

# the streamed experts inside the batched GEMMs: their 1 TFLOP joins the MoE row,
# whose measured time is the whole MoE phase; the streamed row is the H2D alone
inside = dict(summary, expert_streaming={"bytes": 3e9, "batched_passes": 2})
rows_in = {p: (m, b) for p, m, b, _ in prefill_bounds.bounds(inside, 1.0, 2.0, 1.0, 1.0)}
check("moe bound with the streamed experts inside", rows_in["MoE on the device"][1], 4.0 + 1.0)
check("moe measured: the whole phase", rows_in["MoE on the device"][0], 5.0)
check("streamed bound: 3 GB at 1 GB/s", rows_in["streamed experts"][1], 3.0)
if rows_in["streamed experts"][0] is not None:
    print("FAIL streamed measured: %r, want None (inside the MoE row)" % (rows_in["streamed experts"][0],))
    ok = False
check("whole bound unchanged", rows_in["whole prefill"][1], 7.0)

with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "s.json")
    out_json = os.path.join(d, "out.json")
    json.dump([{"name": "synthetic", "rc": 0, "summary": summary}], open(path, "w"))
    p = subprocess.run([sys.executable, TOOL, path, "--gemm-tflops", "1", "--attention-tflops", "2", "--h2d-gbps", "1",
                        "--d2h-gbps", "1", "--json", out_json], capture_output=True, text=True)
    if p.returncode != 0 or "synthetic" not in p.stdout or "whole prefill" not in p.stdout:
        print("FAIL the CLI run: rc %d\n%s%s" % (p.returncode, p.stdout, p.stderr))
        ok = False
    else:
        doc = json.load(open(out_json))
        check("JSON whole bound", doc["runs"][0]["rows"][-1]["bound_seconds"], 7.0)
    for bad, words in ((["--h2d-gbps", "0"], "--h2d-gbps must be > 0"), ([], "give --gemm-tflops or --expert-gemm-json")):
        args = [sys.executable, TOOL, path, "--attention-tflops", "2", "--h2d-gbps", "1", "--d2h-gbps", "1"]
        args += ["--gemm-tflops", "1"] if bad else []
        args += bad
        p = subprocess.run(args, capture_output=True, text=True)
        if p.returncode == 0 or words not in p.stderr:
            print("FAIL refusal %s: rc %d, %s" % (bad, p.returncode, p.stderr.strip()))
            ok = False
    if len(sys.argv) > 1:  # a real ws_decode --json summary (ctest passes one)
        p = subprocess.run([sys.executable, TOOL, sys.argv[1], "--gemm-tflops", "1", "--attention-tflops", "1",
                            "--h2d-gbps", "1", "--d2h-gbps", "1"], capture_output=True, text=True)
        if p.returncode != 0 or "attention + projections" not in p.stdout:
            print("FAIL on %s: rc %d\n%s%s" % (sys.argv[1], p.returncode, p.stdout, p.stderr))
            ok = False
print("prefill_bounds tests:", "passed" if ok else "FAILED")
sys.exit(0 if ok else 1)
