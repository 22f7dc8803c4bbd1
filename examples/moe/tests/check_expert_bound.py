#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The decode step's CPU experts against their bound in a ws_decode --json
summary (CUDA path, here emulated): the `cpu_expert_bound` object.

    check_expert_bound.py SUMMARY.json --config CONFIG.json --cpu-threads N [--exact-all-host]

Checks
  * every field is there; the per-step series have one entry per decode step;
  * the means are those of the per-step series over steps [steps_first:];
    bound = bytes / ceiling, outside = span - windows - trips, step bound =
    bound + outside, the two ratios; no part of a step's GPU span negative;
  * the ceiling was measured with the CPU experts' threads (--cpu-threads);
  * the overlap windows' phases: every one there and >= 0, their GPU window
    and CPU experts the fields above, the host window the sum of its parts;
  * the bytes against counts made without the decoder's byte counter:
      - every step reads whole experts (a multiple of one host expert's bytes,
        the placement's experts_host_bytes / host experts);
      - per step at least top-k distinct experts per MoE layer when every expert
        is on the host, and never more than min(batch x top-k, host experts of
        the layer) per MoE layer;
      - at batch 1 (each routed expert of a layer is distinct): the decode's
        host rows (placement: decode_routed_rows - decode_device_rows) x one
        expert's bytes = the bytes over every step;
      - --exact-all-host (batch 1, every expert on the host): each step reads
        MoE layers x top-k experts.
"""
import argparse
import json
import sys


def fail(msg):
    print("check_expert_bound: FAIL: " + msg)
    sys.exit(1)


def close(a, b, what, rel=1e-9, abs_=1e-12):
    if abs(a - b) > max(abs_, rel * max(abs(a), abs(b))):
        fail(f"{what}: {a!r} != {b!r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("summary")
    ap.add_argument("--config", required=True)
    ap.add_argument("--cpu-threads", type=int, required=True)
    ap.add_argument("--exact-all-host", action="store_true")
    a = ap.parse_args()
    j = json.load(open(a.summary))
    cfg = json.load(open(a.config))

    b = j.get("cpu_expert_bound")
    if not isinstance(b, dict):
        fail("no cpu_expert_bound object")
    keys = ["dram_ceiling", "dram_read_gbps", "dram_buffer_bytes", "dram_threads", "dram_passes", "dram_seconds",
            "steps_first", "steps", "host_read_bytes_per_step", "cpu_bound_seconds_per_step",
            "cpu_expert_seconds_per_step", "cpu_ratio", "gpu_span_seconds_per_step", "overlap_window_seconds_per_step",
            "routing_trip_seconds_per_step", "gpu_outside_seconds_per_step", "step_seconds_per_step",
            "step_bound_seconds_per_step", "step_ratio", "per_step"]
    for k in keys:
        if k not in b:
            fail(f"cpu_expert_bound.{k} missing")
    if b["dram_ceiling"] != "measured":
        fail(f"dram_ceiling is {b['dram_ceiling']!r}, expected 'measured'")
    if not (b["dram_read_gbps"] or 0) > 0:
        fail(f"dram_read_gbps {b['dram_read_gbps']!r}")
    if b["dram_threads"] != a.cpu_threads:
        fail(f"dram_threads {b['dram_threads']} != the CPU experts' threads {a.cpu_threads}")
    # the emulated executor reads 64 MiB (device_decoder.hpp), the GPU path max(1 GiB, 8 x L3)
    least = (64 << 20) if "emulated" in j.get("backend", "") else (1 << 30)
    if b["dram_buffer_bytes"] < least:
        fail(f"dram_buffer_bytes {b['dram_buffer_bytes']} < {least}")

    steps = len(j["step_seconds"])
    ps = b["per_step"]
    for k in ["host_read_bytes", "cpu_expert_seconds", "gpu_span_seconds", "overlap_window_seconds",
              "routing_trip_seconds"]:
        if len(ps.get(k, [])) != steps:
            fail(f"per_step.{k} has {len(ps.get(k, []))} entries, step_seconds {steps}")
    first = b["steps_first"]
    if first != (1 if steps > 1 else 0) or b["steps"] != steps - first:
        fail(f"steps_first {first}, steps {b['steps']} for {steps} decode steps")

    def mean(v):
        v = v[first:]
        return sum(v) / len(v)

    close(b["host_read_bytes_per_step"], mean(ps["host_read_bytes"]), "host_read_bytes_per_step")
    close(b["cpu_expert_seconds_per_step"], mean(ps["cpu_expert_seconds"]), "cpu_expert_seconds_per_step")
    close(b["gpu_span_seconds_per_step"], mean(ps["gpu_span_seconds"]), "gpu_span_seconds_per_step")
    close(b["overlap_window_seconds_per_step"], mean(ps["overlap_window_seconds"]), "overlap_window_seconds_per_step")
    close(b["routing_trip_seconds_per_step"], mean(ps["routing_trip_seconds"]), "routing_trip_seconds_per_step")
    close(b["step_seconds_per_step"], mean(j["step_seconds"]), "step_seconds_per_step")
    bound = b["host_read_bytes_per_step"] / (b["dram_read_gbps"] * 1e9)
    close(b["cpu_bound_seconds_per_step"], bound, "cpu_bound_seconds_per_step = bytes / ceiling")
    outside = b["gpu_span_seconds_per_step"] - b["overlap_window_seconds_per_step"] - b["routing_trip_seconds_per_step"]
    close(b["gpu_outside_seconds_per_step"], outside, "gpu_outside = span - windows - trips")
    close(b["step_bound_seconds_per_step"], bound + outside, "step bound = CPU bound + outside")
    close(b["cpu_ratio"], b["cpu_expert_seconds_per_step"] / bound, "cpu_ratio")
    close(b["step_ratio"], b["step_seconds_per_step"] / (bound + outside), "step_ratio")
    for i in range(steps):
        span, win, trip = ps["gpu_span_seconds"][i], ps["overlap_window_seconds"][i], ps["routing_trip_seconds"][i]
        if min(span, win, trip, ps["cpu_expert_seconds"][i]) < 0 or win + trip > span + 1e-9:
            fail(f"step {i}: span {span}, windows {win}, trips {trip}: the parts do not fit the span")
        if ps["cpu_expert_seconds"][i] > win + 1e-9:
            fail(f"step {i}: CPU experts {ps['cpu_expert_seconds'][i]} s outside their overlap windows {win} s")
        if j["step_seconds"][i] + 1e-9 < span:
            fail(f"step {i}: GPU span {span} s > the step's {j['step_seconds'][i]} s")

    # the overlap windows' phases (milliseconds per step, the same steps)
    if b.get("device_experts_issue") not in ("before", "during"):
        fail(f"device_experts_issue {b.get('device_experts_issue')!r}")
    w = b.get("window_phases_ms_per_step")
    if not isinstance(w, dict):
        fail("no window_phases_ms_per_step object")
    for key in ["layers", "stage_issue", "device_issue", "input_wait", "cpu_setup", "cpu_wake", "cpu_experts",
                "host_window", "output_issue", "gpu_window", "gpu_device_experts", "gpu_output"]:
        if not isinstance(w.get(key), (int, float)) or w[key] < 0:
            fail(f"window_phases_ms_per_step.{key} is {w.get(key)!r}")
    moe_layers = len(j["experts"]["host_per_layer"])
    if not 1 <= w["layers"] <= moe_layers:
        fail(f"window_phases_ms_per_step.layers {w['layers']} outside [1, {moe_layers}]")
    close(w["gpu_window"] * 1e-3, b["overlap_window_seconds_per_step"], "window phases: gpu_window", rel=1e-6)
    close(w["cpu_experts"] * 1e-3, b["cpu_expert_seconds_per_step"], "window phases: cpu_experts", rel=1e-6)
    parts = w["input_wait"] + w["cpu_experts"] + (w["device_issue"] if b["device_experts_issue"] == "before" else 0)
    close(w["host_window"], parts, "window phases: host_window = (device_issue) + input_wait + cpu_experts", rel=1e-6,
          abs_=1e-6)
    if w["cpu_setup"] + w["cpu_wake"] > w["cpu_experts"] + 1e-6:
        fail(f"window phases: cpu setup {w['cpu_setup']} + wake {w['cpu_wake']} > cpu_experts {w['cpu_experts']}")

    # the bytes, against counts made without the decoder's byte counter
    ex, dev, pl = j["experts"], j["device"], j["placement"]
    if ex["host"] <= 0:
        fail("no host experts: the bytes cannot be checked")
    per_expert = dev["experts_host_bytes"] // ex["host"]
    if per_expert * ex["host"] != dev["experts_host_bytes"]:
        fail(f"host experts of unequal size ({dev['experts_host_bytes']} bytes for {ex['host']})")
    k = cfg["num_experts_per_tok"]
    if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
        fail("the check assumes every layer is a MoE layer")
    host_per_layer = [len(h) for h in ex["host_per_layer"]]
    experts_per_layer = ex["total"] // len(host_per_layer)
    batch = j["batch"]
    for i, by in enumerate(ps["host_read_bytes"]):
        if by % per_expert:
            fail(f"step {i}: {by} bytes is not a whole number of {per_expert}-byte experts")
        n = j["step_sequences"][i]
        most = sum(min(n * k, h) for h in host_per_layer) * per_expert
        if by > most:
            fail(f"step {i}: {by} bytes > {most} (per MoE layer min(sequences x top-k, host experts))")
        if all(h == experts_per_layer for h in host_per_layer) and by < len(host_per_layer) * k * per_expert:
            fail(f"step {i}: {by} bytes < MoE layers x top-k experts, every expert on the host")
        if a.exact_all_host and by != len(host_per_layer) * k * per_expert:
            fail(f"step {i}: {by} bytes != {len(host_per_layer)} MoE layers x top-{k} x {per_expert} bytes")
    if batch == 1:
        host_rows = pl["decode_routed_rows"] - pl["decode_device_rows"]
        if sum(ps["host_read_bytes"]) != host_rows * per_expert:
            fail(f"bytes over the steps {sum(ps['host_read_bytes'])} != decode host rows {host_rows} x {per_expert}")
        if host_rows <= 0:
            fail("no decode host rows: the run checks nothing")
    print(f"check_expert_bound: ok ({steps} steps, {b['host_read_bytes_per_step']:.0f} bytes/step, "
          f"ceiling {b['dram_read_gbps']:.1f} GB/s, CPU {b['cpu_ratio']:.2f}x, step {b['step_ratio']:.2f}x)")


if __name__ == "__main__":
    main()
