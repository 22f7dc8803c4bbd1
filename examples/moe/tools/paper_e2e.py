#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""paper_e2e.py: the plan, the tables and the cross-call summary of
device-paper-e2e.sh (the paper's end-to-end experiments at a 32 GB budget, issue
#18 item 5; the script's header says how to run them).

  paper_e2e.py plan                     # env as device-paper-e2e.sh: SET, PART, RUNS, ...
  paper_e2e.py report RUNS_DIR PLAN.tsv CALL.json OUT.json OUT.txt [HOSTMEM.txt]
  paper_e2e.py summarize E2E.json... [--json OUT]

plan     prints the plan (every run of the chosen sets: part, shape, policy, the
         estimated seconds) and the shapes that cannot run (host memory, computed
         below), on stderr; on stdout one tab-separated line per run of the chosen
         SET/PART/RUNS for the shell: part set name model layers batch prompt new est cap args.
report   merges device-decode.sh's per-run decode.json files into one JSON (the
         call's identity, every run's plan entry and ws_decode --json summary) and
         prints the set's table.
summarize  one table over several calls' JSONs: which call each run came from, and
         the ratios of decode tok/s roofline / gpu_only, / cpu_only, / fixed per
         model, batch and context, only between runs of one call.

Run sets (Fig. 8 and 9 of the paper, §7.2; ws_decode --device cuda --random-weights
--config examples/moe/configs/<model>.json, every layer, --vram-budget 29.8):
  prefill    2,000-token prompts (PREFILL_LEN) x batch 4/8/16/32 (PREFILL_BATCHES), 2
             new tokens (PREFILL_NEW), roofline; prefill tok/s = the summary's
             prefill_tok_s (every prompt token / the prefill's wall time).
  decode8k, decode32k
             context 8,192 / 32,768 (CTX_8K, CTX_32K) x batch 4/16/32 (DECODE_BATCHES)
             x the policies roofline, gpu_only, cpu_only, fixed:0.5 (POLICIES, FIXED):
             prefill to the target, then decode a window: --prompt-len CTX-W
             --max-new-tokens W (WINDOW, default 16; the last step attends CTX-1
             tokens). The paper decodes from a 2K prompt to the target and reports
             the cumulative rate; 6K-30K decode steps at 0.1-1 s each do not fit a
             10-minute call, so this measures the rate at the target context (the
             slowest point of the paper's curve), not its mean.

Time model (seconds of one run; constants below, from the H200 runs of
docs/results/h200-2026-12-02-s14 and h200-2026-12-05): setup (random-weight
generation and page-locking, warm-up, DRAM ceiling, teardown) + KV setup (the
prompts' unpinned pages made resident and the pinned region page-locked ahead: 8.5 s
for 15.6 GiB) + prefill (0.5 s + tokens / rate) + new tokens x (TPOT at a 2K context
+ the KV beyond 2K read at ATT_GBPS, the H2D rate: gpu_only's cost, an upper bound
for the other policies). Unmeasured entries are marked "guess" in MODELS.

Host memory model (the shapes that cannot run): ws_decode's CUDA path refuses only
host experts beyond 80 % of RAM (--max-host-weights-gib); the KV is not checked.
Before the prefill it makes resident the unpinned region's pages for every prompt
block and page-locks the pinned region for the same blocks (device_decoder.hpp,
"made resident now ... page-locked ahead"), whatever the policy: two copies of the
prompts' KV in host memory. Need = host experts (measured counts at 29.8 GiB with
32K-token prefill waves, the largest workspaces: the fewest experts on the GPU) x
expert bytes + 2 x batch x prompt x KV bytes per token + HOST_OVERHEAD_GIB; a shape
runs when the need <= HOST_LIMIT_GIB (default 120 of the machine's 125.9 GiB).
"""
import fnmatch
import json
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
CONFIGS = os.path.join(ROOT, "examples", "moe", "configs")
GIB = float(1 << 30)

# Per model: the public config, the run's constants. host_experts: routed experts in
# host memory at --vram-budget 29.8, the most measured (32K-token prefill waves and
# their workspaces; h200-2026-12-02-s14 and h200-2026-12-05: Qwen3 4,428 of 6,144 at
# 32 x 2000, DeepSeek-V2-Lite 973 of 1,664 and Mixtral 245 of 256 at 4 x 32K). setup_s:
# wall - prefill - steps - KV setup of those runs (Qwen3 26-31 s, 2026-12-05; DSV2
# 11-18 s, Mixtral 77 s). prefill_tok_s: the full-depth 4 x 32K rates at 29.8 GiB
# (24.6K, 43.8K, 13.9K; Qwen3 b4 x 2000 ran at 11.9K, b16/b32 at 38K). tpot_s: the
# decode step at a ~2K context by batch (Qwen3 measured 2026-12-05; Mixtral b4 6.6
# tok/s; the rest guesses).
MODELS = {
    "qwen3": {"config": "qwen3_30b_a3b.json", "host_experts": 4428, "setup_s": 30.0, "prefill_tok_s": 25e3,
              "tpot_s": {4: 0.125, 16: 0.268, 32: 0.418}, "tpot_src": "measured"},
    "dsv2lite": {"config": "deepseek_v2_lite.json", "host_experts": 973, "setup_s": 16.0, "prefill_tok_s": 40e3,
                 "tpot_s": {4: 0.06, 16: 0.11, 32: 0.16}, "tpot_src": "guess"},
    "mixtral": {"config": "mixtral_8x7b.json", "host_experts": 245, "setup_s": 75.0, "prefill_tok_s": 13e3,
                "tpot_s": {4: 0.61, 16: 0.9, 32: 1.0}, "tpot_src": "b4 measured, b16/b32 guess"},
}
KV_SETUP_S_PER_GIB = 8.5 / 15.6  # one copy's GiB: prefault 1.9 s + page-lock 6.6 s for 15.6 GiB
SET_ORDER = ("prefill", "decode8k", "decode32k")
SHORT = {"prefill": "pf", "decode8k": "d8k", "decode32k": "d32k"}


def env(name, default):
    v = os.environ.get(name, "")
    return v if v != "" else default


def model_facts(name):
    m = dict(MODELS[name])
    c = json.load(open(os.path.join(CONFIGS, m["config"])))
    H = c["hidden_size"]
    if c.get("kv_lora_rank"):  # MLA: the compressed latent + the RoPE key, bf16
        kv = (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 2
        inter = c["moe_intermediate_size"]
    else:  # GQA: K and V of every KV head, bf16
        hd = c.get("head_dim") or H // c["num_attention_heads"]
        kv = 2 * c["num_key_value_heads"] * hd * 2
        inter = c.get("moe_intermediate_size") or c["intermediate_size"]
    m["layers"] = c["num_hidden_layers"]
    m["kv_token_layer_bytes"] = kv
    m["expert_bytes"] = 3 * H * inter * 2  # gate, up, down, bf16
    m["max_positions"] = c.get("max_position_embeddings") or 0
    return m


def tpot_at(table, b):
    ks = sorted(table)
    if b <= ks[0]:
        return table[ks[0]]
    for lo, hi in zip(ks, ks[1:]):
        if b <= hi:
            return table[lo] + (table[hi] - table[lo]) * (b - lo) / (hi - lo)
    return table[ks[-1]] * b / ks[-1]


class Knobs:
    def __init__(self):
        self.layers = int(env("LAYERS", "0"))  # 0 = the model's every layer
        self.budget_gib = env("BUDGET_GIB", "29.8")
        self.models = env("MODELS", "qwen3 dsv2lite mixtral").split()
        self.prefill_batches = [int(x) for x in env("PREFILL_BATCHES", "4 8 16 32").split()]
        self.decode_batches = [int(x) for x in env("DECODE_BATCHES", "4 16 32").split()]
        self.prefill_len = int(env("PREFILL_LEN", "2000"))
        self.prefill_new = int(env("PREFILL_NEW", "2"))
        self.ctx = {"decode8k": int(env("CTX_8K", "8192")), "decode32k": int(env("CTX_32K", "32768"))}
        self.window = int(env("WINDOW", "16"))
        self.policies = env("POLICIES", "roofline gpu_only cpu_only fixed").split()
        self.fixed = env("FIXED", "0.5")
        self.part_budget = float(env("PART_BUDGET", "450"))
        self.att_gbps = float(env("ATT_GBPS", "50"))
        self.host_limit = float(env("HOST_LIMIT_GIB", "120"))
        self.host_overhead = float(env("HOST_OVERHEAD_GIB", "4"))
        self.extra = env("EXTRA", "")


def policy_arg(p, k):
    return "fixed:" + k.fixed if p == "fixed" else p


def host_need(m, batch, prompt, k):
    experts = m["host_experts"] * m["expert_bytes"] / GIB * m["layers_run"] / m["layers"]
    kv_one = batch * prompt * m["kv_token_layer_bytes"] * m["layers_run"] / GIB
    return experts, kv_one, experts + 2 * kv_one + k.host_overhead


def estimate(m, batch, prompt, new, k):
    _, kv_one, _ = host_need(m, batch, prompt, k)
    tokens = batch * prompt
    depth = m["layers_run"] / m["layers"]
    att = batch * max(0, prompt + new - 2000) * m["kv_token_layer_bytes"] * m["layers_run"] / (k.att_gbps * 1e9)
    step = tpot_at(m["tpot_s"], batch) * depth + att
    return m["setup_s"] * max(depth, 0.3) + KV_SETUP_S_PER_GIB * kv_one + 0.5 + tokens / m["prefill_tok_s"] * depth \
        + new * step


def build_plan(k):
    """Every run of every set: (set, group, entry) with entry a dict; and the infeasible shapes."""
    runs, infeasible = [], []
    for set_name in SET_ORDER:
        for mname in k.models:
            if mname not in MODELS:
                raise SystemExit(f"paper_e2e: unknown model {mname} (known: {' '.join(MODELS)})")
            m = model_facts(mname)
            m["layers_run"] = k.layers if 0 < k.layers < m["layers"] else m["layers"]
            if set_name == "prefill":
                shapes = [(b, k.prefill_len, k.prefill_new, ["roofline"]) for b in k.prefill_batches]
            else:
                ctx = k.ctx[set_name]
                shapes = [(b, ctx - k.window, k.window, k.policies) for b in k.decode_batches]
            for batch, prompt, new, policies in shapes:
                experts, kv_one, need = host_need(m, batch, prompt, k)
                shape = f"{mname} {batch} x {prompt} + {new}"
                if need > k.host_limit:
                    infeasible.append({
                        "set": set_name, "shape": shape, "host_experts_gib": experts, "kv_gib": kv_one,
                        "need_gib": need, "need_one_copy_gib": need - kv_one, "limit_gib": k.host_limit})
                    continue
                if m["max_positions"] and prompt + new - 1 > m["max_positions"]:
                    infeasible.append({"set": set_name, "shape": shape, "positions": prompt + new - 1,
                                       "max_positions": m["max_positions"]})
                    continue
                group = f"{set_name}:{mname}" if set_name == "prefill" else f"{set_name}:{mname}:b{batch}"
                for p in policies:
                    name = f"{SHORT[set_name]}.{mname}.b{batch}" + ("" if set_name == "prefill" else "." + p)
                    est = estimate(m, batch, prompt, new, k)
                    args = f"--policy {policy_arg(p, k)} --vram-budget {k.budget_gib}"
                    if k.extra:
                        args += " " + k.extra
                    runs.append({"set": set_name, "group": group, "name": name, "model": mname,
                                 "layers": m["layers_run"], "batch": batch, "prompt": prompt, "new": new,
                                 "policy": p, "context": prompt + new, "est_s": est, "cap_s": 1.6 * est + 30,
                                 "host_need_gib": need, "args": args})
    # parts: whole groups (a shape's four policies, a model's prefill batches) packed
    # first-fit decreasing into PART_BUDGET seconds, per set; deterministic.
    for set_name in SET_ORDER:
        groups = {}
        for r in runs:
            if r["set"] == set_name:
                groups.setdefault(r["group"], []).append(r)
        order = sorted(groups, key=lambda g: (-sum(r["est_s"] for r in groups[g]), g))
        parts = []
        for g in order:
            t = sum(r["est_s"] for r in groups[g])
            for p in parts:
                if p["t"] + t <= k.part_budget:
                    p["groups"].append(g)
                    p["t"] += t
                    break
            else:
                parts.append({"groups": [g], "t": t})
        for i, p in enumerate(parts, 1):
            for g in p["groups"]:
                for r in groups[g]:
                    r["part"] = i
    runs.sort(key=lambda r: (SET_ORDER.index(r["set"]), r["part"], r["group"], r["name"]))
    return runs, infeasible


def cmd_plan():
    k = Knobs()
    runs, infeasible = build_plan(k)
    sets = env("SET", "prefill").split(",")
    sets = list(SET_ORDER) if sets == ["all"] else sets
    for s in sets:
        if s not in SET_ORDER:
            raise SystemExit(f"paper_e2e: SET={s}: one of {', '.join(SET_ORDER)} or all")
    part = env("PART", "all")
    pats = env("RUNS", "*").split()
    chosen = [r for r in runs if r["set"] in sets and (part == "all" or str(r["part"]) == part)
              and any(fnmatch.fnmatch(r["name"], p) for p in pats)]
    e = sys.stderr
    print(f"paper e2e plan: --vram-budget {k.budget_gib}, window {k.window}, policies {' '.join(k.policies)}"
          f" (fixed:{k.fixed}), part budget {k.part_budget:.0f} s; * = chosen for this call", file=e)
    print(f"{'set':9} {'part':>4} {'run':28} {'batch':>5} {'prompt':>6} {'new':>4} {'host GiB':>8} {'est s':>6}", file=e)
    tot = {}
    for r in runs:
        key = (r["set"], r["part"])
        tot[key] = tot.get(key, 0.0) + r["est_s"]
        mark = "*" if r in chosen else " "
        print(f"{r['set']:9} {r['part']:>4} {mark}{r['name']:27} {r['batch']:>5} {r['prompt']:>6} {r['new']:>4} "
              f"{r['host_need_gib']:>8.1f} {r['est_s']:>6.0f}", file=e)
    print("parts (set/part: runs, estimated seconds):", file=e)
    for (s, p), t in tot.items():
        n = sum(1 for r in runs if r["set"] == s and r["part"] == p)
        print(f"  SET={s} PART={p}: {n} runs, {t:.0f} s", file=e)
    print(f"  all parts: {len(runs)} runs, {sum(tot.values()):.0f} s", file=e)
    if infeasible:
        print(f"shapes that cannot run (host memory need > HOST_LIMIT_GIB {k.host_limit:g}: host experts"
              f" + 2 x the prompts' KV + {k.host_overhead:g} GiB; or past max_position_embeddings):", file=e)
        for x in infeasible:
            if "need_gib" in x:
                print(f"  {x['set']:9} {x['shape']:26} experts {x['host_experts_gib']:.1f} + 2 x KV {x['kv_gib']:.1f}"
                      f" + {k.host_overhead:g} = {x['need_gib']:.1f} GiB (one KV copy: {x['need_one_copy_gib']:.1f})",
                      file=e)
            else:
                print(f"  {x['set']:9} {x['shape']:26} positions {x['positions']} > {x['max_positions']}", file=e)
    print(f"chosen: {len(chosen)} runs, {sum(r['est_s'] for r in chosen):.0f} s estimated", file=e)
    for r in chosen:
        print("\t".join(str(x) for x in (r["part"], r["set"], r["name"], r["model"], r["layers"], r["batch"],
                                         r["prompt"], r["new"], round(r["est_s"]), round(r["cap_s"]), r["args"])))
    plan_json = env("PLAN_JSON", "")
    if plan_json:
        json.dump({"runs": runs, "infeasible": infeasible}, open(plan_json, "w"), indent=1)


def fmt(v, f):
    return format(v, f) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def row_of(r):
    """One run's figures from its ws_decode summary (None where it did not run)."""
    s = r.get("summary") or {}
    ex = s.get("experts") if isinstance(s.get("experts"), dict) else {}
    dv = s.get("device") if isinstance(s.get("device"), dict) else {}
    mem = s.get("memory_bytes") if isinstance(s.get("memory_bytes"), dict) else {}
    peak = dv.get("peak_process_bytes")
    budget = dv.get("budget_bytes")
    host_kv = None
    if mem:
        host_kv = ((mem.get("unpinned_reserved") or 0) + (mem.get("pinned_reserved") or 0)) / GIB
    share = s.get("cpu_share")
    return {
        "prefill_tok_s": s.get("prefill_tok_s"), "prefill_s": s.get("prefill_seconds"),
        "decode_tok_s": s.get("decode_steady_tok_s") or s.get("decode_tok_s"),
        "tpot_ms": s.get("tpot_steady_p50_ms") or s.get("tpot_p50_ms"),
        "experts": f"{ex.get('gpu', '-')}/{ex.get('host', '-')}" if ex else "-",
        "peak_gib": peak / GIB if isinstance(peak, (int, float)) and peak >= 0 else None,
        "budget_gib": budget / GIB if isinstance(budget, (int, float)) and budget > 0 else None,
        "cpu_share": share if isinstance(share, (int, float)) else None,
        "host_kv_gib": host_kv, "error": s.get("error"),
    }


def table(runs, call_col=False):
    lines = []
    head = (f"{'call':4} " if call_col else "") + (
        f"{'run':28} {'rc':>3} {'ctx':>6} {'prefill tok/s':>13} {'decode tok/s':>12} {'TPOT ms':>8} "
        f"{'experts GPU/host':>16} {'NVML/budget GiB':>15} {'CPU share':>9} {'host KV GiB':>11} {'host peak':>9} "
        f"{'s':>4} {'est':>4}")
    lines.append(head)
    for r in runs:
        f = row_of(r)
        pre = f"{r.get('call', '-'):4} " if call_col else ""
        if r.get("rc") != "0" or not r.get("summary") or f["error"]:
            why = f["error"] or r.get("note") or ""
            lines.append(f"{pre}{r['name']:28} {r.get('rc', '-')!s:>3} {r.get('context', '-')!s:>6} {why!s:.100}")
            continue
        nv = f"{fmt(f['peak_gib'], '.2f')}/{fmt(f['budget_gib'], '.2f')}"
        lines.append(
            f"{pre}{r['name']:28} {r['rc']:>3} {r.get('context', '-')!s:>6} {fmt(f['prefill_tok_s'], '.0f'):>13} "
            f"{fmt(f['decode_tok_s'], '.1f'):>12} {fmt(f['tpot_ms'], '.1f'):>8} {f['experts']:>16} {nv:>15} "
            f"{fmt(f['cpu_share'], '.3f'):>9} {fmt(f['host_kv_gib'], '.1f'):>11} "
            f"{fmt(r.get('host_peak_gib'), '.1f'):>9} {r.get('seconds', '-')!s:>4} {fmt(r.get('est_s'), '.0f'):>4}")
    return lines


NOTES = ["decode tok/s, TPOT: steady state (the decode steps after the first); prefill tok/s: prompt tokens / the",
         "prefill's wall time; NVML: this process's device memory peak (sampled at every phase and decode step)",
         "against the budget; CPU share: of the placed KV at the end; host KV: the unpinned + pinned regions' bytes",
         "reserved (both hold every prompt block); host peak: MemTotal - the least MemAvailable sampled in the run",
         "(GiB, every 2 s); est: the plan's estimate. decode8k/32k: prefill to the target context, then a window of",
         "new tokens (not the paper's cumulative 2K -> target mean)."]


def hostmem_samples(path):
    out = []
    if path and os.path.exists(path):
        for line in open(path):
            p = line.split()
            if len(p) == 3:
                out.append((float(p[0]), float(p[1]), float(p[2])))
    return out


def cmd_report(runs_dir, plan_tsv, call_json, out_json, out_txt, hostmem=None):
    call = json.load(open(call_json))
    samples = hostmem_samples(hostmem)
    merged = []
    for line in open(plan_tsv):
        p = line.rstrip("\n").split("\t")
        if len(p) < 11:
            continue
        part, set_name, name, model, layers, batch, prompt, new, est, cap, args = p[:11]
        entry = {"name": name, "call_id": call["id"], "set": set_name, "part": int(part), "model": model,
                 "layers": int(layers), "batch": int(batch), "prompt": int(prompt), "new": int(new),
                 "context": int(prompt) + int(new), "policy": None, "est_s": float(est), "args": args,
                 "rc": "not run", "seconds": 0, "note": "", "command": "", "summary": None}
        a = args.split()
        if "--policy" in a:
            entry["policy"] = a[a.index("--policy") + 1]
        d = os.path.join(runs_dir, name)
        dj = os.path.join(d, "decode.json")
        if os.path.exists(dj):
            got = json.load(open(dj))
            if got:
                for key in ("rc", "seconds", "note", "command", "summary"):
                    entry[key] = got[0].get(key)
        skip = os.path.join(d, "skipped")
        if os.path.exists(skip):
            entry["rc"] = "skipped"
            entry["note"] = open(skip).read().strip()
        span = os.path.join(d, "span")
        if os.path.exists(span) and samples:
            t0, t1 = (float(x) for x in open(span).read().split())
            inside = [s for s in samples if t0 <= s[0] <= t1]
            if inside:
                entry["host_peak_gib"] = max(s[1] - s[2] for s in inside) / (1 << 20)  # kB -> GiB
        merged.append(entry)
    doc = {"call": call, "runs": merged}
    json.dump(doc, open(out_json, "w"), indent=1)
    lines = [f"call {call['id']} (host {call.get('host')}, started {call.get('started')}): SET={call['set']}"
             f" PART={call['part']} RUNS={call.get('runs_filter')}"]
    lines += table(merged) + NOTES
    open(out_txt, "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


def cmd_summarize(paths, out=None):
    runs = []
    calls = []
    for path in paths:
        doc = json.load(open(path))
        calls.append(doc["call"])
        for r in doc["runs"]:
            r = dict(r)
            r["call_id"] = doc["call"]["id"]
            runs.append(r)
    # short labels c1, c2, ... in file order; the calls' ids beside them
    label = {}
    for c in calls:
        label.setdefault(c["id"], f"c{len(label) + 1}")
    for r in runs:
        r["call"] = label[r["call_id"]]
    lines = ["calls:"]
    for c in calls:
        lines.append(f"  {label[c['id']]}: {c['id']} (host {c.get('host')}, started {c.get('started')}, commit "
                     f"{c.get('commit')}): SET={c['set']} PART={c['part']} RUNS={c.get('runs_filter')}")
    runs.sort(key=lambda r: (SET_ORDER.index(r["set"]) if r["set"] in SET_ORDER else 9, r["model"], r["batch"],
                             r["context"], r["name"]))
    lines += table(runs, call_col=True)
    # ratios of decode tok/s within one call, per model, batch and context
    ratios = []
    groups = {}
    for r in runs:
        if r["set"] == "prefill":
            continue
        groups.setdefault((r["call_id"], r["model"], r["batch"], r["context"]), {})[
            (r.get("policy") or "").split(":")[0]] = row_of(r)["decode_tok_s"] if r.get("rc") == "0" else None
    lines.append("")
    lines.append("decode tok/s ratios, runs of one call only (x = roofline / the other policy):")
    lines.append(f"{'call':4} {'model':9} {'batch':>5} {'ctx':>6} {'roofline':>9} {'/gpu_only':>9} {'/cpu_only':>9} "
                 f"{'/fixed':>9}")
    for (cid, model, batch, ctx), pol in sorted(groups.items(), key=lambda kv: kv[0][1:] + (kv[0][0],)):
        if not any(isinstance(v, (int, float)) for v in pol.values()):
            continue  # nothing of this shape ran in this call
        rl = pol.get("roofline")
        rat = {}
        for other in ("gpu_only", "cpu_only", "fixed"):
            o = pol.get(other)
            rat[other] = rl / o if isinstance(rl, (int, float)) and isinstance(o, (int, float)) and o > 0 else None
        ratios.append({"call": label[cid], "call_id": cid, "model": model, "batch": batch, "context": ctx, "roofline_tok_s": rl,
                       "over_gpu_only": rat["gpu_only"], "over_cpu_only": rat["cpu_only"], "over_fixed": rat["fixed"]})
        lines.append(f"{label[cid]:4} {model:9} {batch:>5} {ctx:>6} {fmt(rl, '.1f'):>9} {fmt(rat['gpu_only'], '.2f'):>9} "
                     f"{fmt(rat['cpu_only'], '.2f'):>9} {fmt(rat['fixed'], '.2f'):>9}")
    # the same shape measured in more than one call: listed, never divided
    seen = {}
    for r in runs:
        if r.get("rc") == "0":
            seen.setdefault(r["name"], set()).add(r["call_id"])
    again = sorted(n for n, c in seen.items() if len(c) > 1)
    if again:
        lines.append("runs measured in more than one call (no ratio across calls): " + ", ".join(again))
    lines += NOTES
    print("\n".join(lines))
    if out:
        json.dump({"calls": calls, "runs": runs, "ratios": ratios}, open(out, "w"), indent=1)


def main(argv):
    if len(argv) >= 2 and argv[1] == "plan":
        cmd_plan()
    elif len(argv) >= 7 and argv[1] == "report":
        cmd_report(*argv[2:8])
    elif len(argv) >= 3 and argv[1] == "summarize":
        paths, out = [], None
        it = iter(argv[2:])
        for a in it:
            if a == "--json":
                out = next(it)
            else:
                paths.append(a)
        cmd_summarize(paths, out)
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
