# SPDX-License-Identifier: Apache-2.0
"""WriteScopeCache + the "writescope" attention under transformers' generate(), against
DynamicCache + SDPA, on tiny random models of each GQA architecture."""

import functools
import re

import pytest
import torch
from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

import writescope
from writescope.hf import WriteScopeCache

from conftest import ARCHS, bf16_kv_dynamic_cache, device_of, tiny_model

NEW_TOKENS = 64
# Small blocks and D so that prompts place whole batches and decoding evicts: the
# 22..40-token prompts and 64 new tokens cross the D = 32 boundary 2-3 times per row.
SPEC = dict(block_tokens=16, d_window_tokens=32, cpu_threads=1)
POLICIES = [0.0, 0.5, 1.0, "roofline"]


def prompts(device, batch=3, length=40, seed=1):
    """Left-padded prompts (transformers' layout for decoder-only generation)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in zip(range(batch), (0, 7, 18)[:batch]):
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    return ids.to(device), mask.to(device)


def reference(model, ids, mask, new_tokens=NEW_TOKENS, **kw):
    """DynamicCache + SDPA, decode steps over bf16-rounded cached K/V (the cache's precision)."""
    return model.generate(input_ids=ids, attention_mask=mask, past_key_values=bf16_kv_dynamic_cache(),
                          max_new_tokens=new_tokens, min_new_tokens=kw.pop("min_new_tokens", new_tokens),
                          do_sample=False, pad_token_id=0, **kw)


def generate(model, ids, mask, cache, new_tokens=NEW_TOKENS):
    return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"r={p}" if isinstance(p, float) else p)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_dynamic_cache_fp32(arch, policy, backend):
    dev = device_of(backend)
    model = tiny_model(arch, device=dev)
    ids, mask = prompts(dev)
    ref = reference(model, ids, mask)
    cache = WriteScopeCache(model, policy=policy, backend=backend, **SPEC)
    out = generate(model, ids, mask, cache)
    assert out.shape == ref.shape
    assert torch.equal(out, ref), f"first differing positions: {(out != ref).nonzero()[:4].tolist()}"
    # The step attended the split the policy chose: check where the placed tokens are.
    split = cache.split()
    placed = split["cpu_tokens"] + split["pinned_tokens"]
    assert placed > 0 and cache.last_flush is not None
    if policy == 0.0:
        assert split["cpu_tokens"] == 0
    elif policy == 1.0:
        assert split["pinned_tokens"] == 0
    else:
        assert split["cpu_tokens"] > 0 and split["pinned_tokens"] > 0
    # Every real token of every row is cached, none of the padding.
    real = mask.sum(dim=1).tolist()
    for row, seq in enumerate(cache._seqs):
        st = cache.kv.sequence(seq)
        assert st["placed_tokens"] + st["window_tokens.0"] == real[row] + NEW_TOKENS - 1


def fp32_decode_reference(cache):
    """Registers (under a name it returns) an attention function for a reference run over `cache`, a
    DynamicCache: prompts through the model's SDPA as they are (the "writescope" attention does the
    same, so both runs' prompts are identical), decode steps in fp32 from the bf16 cached K/V, as
    writescope attends them, rounded to the model's dtype once. MLA (DeepSeek-V2, whose modules expand
    the cached latent into K/V with kv_b_proj in bf16 before the attention call): K/V are expanded from
    the cached latent again, in fp32, as writescope's absorbed form multiplies it in fp32."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        if query.shape[2] != 1:
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        if hasattr(module, "kv_b_proj"):
            layer = cache.layers[module.layer_idx]
            c_kv, k_pe = layer.keys.float(), layer.values.float()  # [b, 1, tokens, rank], [b, 1, tokens, rope]
            b, _, n, _ = c_kv.shape
            kv = torch.nn.functional.linear(c_kv[:, 0], module.kv_b_proj.weight.float())
            kv = kv.view(b, n, -1, module.qk_nope_head_dim + module.v_head_dim).transpose(1, 2)
            k_nope, value = kv.split([module.qk_nope_head_dim, module.v_head_dim], dim=-1)
            key = torch.cat([k_nope, k_pe.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                              **kwargs)
        return out.to(query.dtype), weights

    name = "writescope_test_fp32_decode_reference"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


class RoutingLog:
    """The experts each MoE router of `model` picks, per model forward: forward hooks on the routers of
    transformers' MoE blocks (Qwen3MoeTopKRouter, MixtralTopKRouter, DeepseekV2TopkRouter), whose
    output's third element is the [tokens, top_k] expert indices. calls[i][layer] is [batch, tokens, k],
    sorted per token (the chosen set)."""

    def __init__(self, model):
        self.calls, self.layers, self._handles = [], [], []
        for name, mod in model.named_modules():
            if type(mod).__name__.lower().endswith("topkrouter"):
                layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
                self.layers.append(layer)
                self._handles.append(mod.register_forward_hook(functools.partial(self._hook, layer)))

    def _hook(self, layer, module, args, out):
        self.calls[-1][layer] = out[2].sort(dim=-1).values.cpu()

    def forward(self, model, batch, **kw):
        self.calls.append({})
        out = model(**kw)
        for layer, idx in self.calls[-1].items():
            self.calls[-1][layer] = idx.view(batch, -1, idx.shape[-1])
        return out

    def remove(self):
        for h in self._handles:
            h.remove()


def routed_alike(a, b, prompt_mask, num_layers):
    """[rows, steps] bool: step s of row r saw the same expert choices in runs a and b (RoutingLogs of
    the same forwards): its own token at every MoE layer, and every earlier token of the row at every
    MoE layer below the last decoder layer (an earlier token's choice there shapes the K/V this step
    attends; the last layer's choice only shapes that token's own logits). Step 0 is the prompt."""
    rows, steps = prompt_mask.shape[0], len(a.calls)
    alike = torch.ones(rows, steps, dtype=torch.bool)
    tainted = torch.zeros(rows, dtype=torch.bool)  # an earlier token's cached K/V differs
    valid = prompt_mask.bool().cpu()
    for s in range(steps):
        own = torch.zeros(rows, dtype=torch.bool)
        feeds = torch.zeros(rows, dtype=torch.bool)
        for layer, idx in a.calls[s].items():
            differs = (idx != b.calls[s][layer]).any(dim=-1)  # [rows, tokens]
            if s == 0:
                differs &= valid  # padding positions are cached by neither run
            differs = differs.any(dim=-1)
            own |= differs
            if layer < num_layers - 1:
                feeds |= differs
        alike[:, s] = ~(own | tainted)
        tainted |= feeds
    return alike


# The bound of the teacher-forcing test: per (row, step) max |logit difference| within
# LOGIT_TOL of that step's max |logit|, on every step whose routing agreed in both runs ...
LOGIT_TOL = 0.03
# ... which must be at least this share of the steps (all of them for dense models) ...
MIN_ROUTED_ALIKE = 0.75
# ... and over all steps, flipped ones included, ||got - ref||_F <= REL_FROBENIUS_TOL * ||ref||_F.
REL_FROBENIUS_TOL = 0.05


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_logits_under_teacher_forcing(arch, backend):
    """bf16 model: the logits of every step against DynamicCache + SDPA, both fed the same tokens
    (teacher forcing: greedy decoding of a random bf16 model flips on near-ties).

    The reference (fp32_decode_reference) computes what writescope computes, in fp32 from the same
    bf16 cached K/V (MLA: from the same bf16 latent), rounded to bf16 once: the model's bf16 SDPA
    would not do (on CUDA the flash and memory-efficient kernels round P to bf16, and MLA's modules
    expand the latent in bf16, each about an ulp of the attention output, everywhere). Both runs'
    prompts go through the same SDPA call, so they are identical. What is left is fp32 summation
    order: a last-bit difference in some attention outputs. But a tiny random MoE model has
    near-tied router logits, so one such bit can flip a top-k expert choice, which moves that step's
    logits by a lot, and the token's K/V (a flip below the last layer) moves every later step of its
    row a little: a max over all steps cannot tell that from a wrong result.

    So the check is routing-aware: forward hooks on the MoE routers record each run's expert choices;
    where routing agreed (the step's own token and every earlier token of the row: routed_alike) the
    two runs computed the same function up to rounding, and every such step must be within LOGIT_TOL
    of its max |logit|. A wrong merge or split moves every step with tokens on both sides by far more
    than that, and flips routing as well, so the routed-alike steps must be most of them
    (MIN_ROUTED_ALIKE), and the relative Frobenius error over all steps, flipped ones included, is
    bounded too (REL_FROBENIUS_TOL)."""
    dev = device_of(backend)
    model = tiny_model(arch, dtype=torch.bfloat16, device=dev)
    num_layers = model.config.num_hidden_layers
    ids, mask = prompts(dev, batch=2, length=36)
    g = torch.Generator().manual_seed(2)
    forced = torch.randint(3, 256, (2, 40), generator=g).to(dev)

    def run(cache):
        log = RoutingLog(model)
        logits = []
        m = mask
        out = log.forward(model, 2, input_ids=ids, attention_mask=m, past_key_values=cache)
        logits.append(out.logits[:, -1].float())
        pos = (m.sum(dim=1, keepdim=True) - 1)
        for t in range(forced.shape[1]):
            m = torch.cat([m, torch.ones_like(m[:, :1])], dim=1)
            pos = pos + 1
            out = log.forward(model, 2, input_ids=forced[:, t:t + 1], attention_mask=m, position_ids=pos,
                              past_key_values=cache)
            logits.append(out.logits[:, -1].float())
        log.remove()
        return torch.stack(logits, dim=1), log

    ref_cache = DynamicCache()
    model.set_attn_implementation(fp32_decode_reference(ref_cache))
    ref, ref_log = run(ref_cache)
    cache = WriteScopeCache(model, policy=0.5, backend=backend, **SPEC)
    got, got_log = run(cache)
    assert cache.split()["cpu_tokens"] > 0 and cache.split()["pinned_tokens"] > 0
    assert bool(ref_log.layers) == (arch not in ("llama", "qwen2")), f"MoE routers found in layers {ref_log.layers}"

    alike = routed_alike(ref_log, got_log, mask, num_layers)
    err = (got - ref).abs().amax(dim=-1).cpu()  # [rows, steps]
    scale = ref.abs().amax(dim=-1).cpu()
    within = err <= LOGIT_TOL * scale
    rel_frobenius = ((got - ref).norm() / ref.norm()).item()
    detail = (f"{int(alike.sum())}/{alike.numel()} steps routed alike, {int((within & alike).sum())} of them within "
              f"{LOGIT_TOL:.0%}; worst routed-alike step: |diff| {(err * alike).max().item():.4g} against max "
              f"|logit| {scale[alike].max().item() if alike.any() else float('nan'):.4g}; steps within "
              f"{LOGIT_TOL:.0%} overall {int(within.sum())}; relative Frobenius error {rel_frobenius:.4g}")
    print(detail)
    assert alike.float().mean().item() >= MIN_ROUTED_ALIKE, detail
    assert bool(within[alike].all()), detail
    assert rel_frobenius <= REL_FROBENIUS_TOL, detail


def test_padded_batch_equals_each_prompt_alone(backend):
    """A left-padded batch gives each row the tokens it gets alone (padding is not cached)."""
    dev = device_of(backend)
    model = tiny_model("qwen3_moe", device=dev)
    ids, mask = prompts(dev)
    batch = generate(model, ids, mask, WriteScopeCache(model, policy=0.5, backend=backend, **SPEC), 40)
    for row in range(ids.shape[0]):
        keep = mask[row].bool()
        one = ids[row:row + 1, keep]
        alone = generate(model, one, torch.ones_like(one), WriteScopeCache(model, policy=0.5, backend=backend, **SPEC), 40)
        assert torch.equal(alone[0, one.shape[1]:], batch[row, ids.shape[1]:]), f"row {row}"


def test_eos_stops_like_dynamic_cache(backend):
    """EOS handled as transformers does: finished rows are padded, the others go on."""
    dev = device_of(backend)
    model = tiny_model("llama", device=dev)
    ids, mask = prompts(dev)
    ref = reference(model, ids, mask)
    eos = int(ref[1, ids.shape[1] + 5])  # a token row 1 emits early
    ref = reference(model, ids, mask, eos_token_id=eos, min_new_tokens=0)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                         pad_token_id=0, eos_token_id=eos,
                         past_key_values=WriteScopeCache(model, policy="roofline", backend=backend, **SPEC))
    assert torch.equal(out, ref)
    assert (ref[1, ids.shape[1] + 6:] == 0).all()


def test_reset_reuses_the_cache(backend):
    dev = device_of(backend)
    model = tiny_model("qwen2", device=dev)
    ids, mask = prompts(dev)
    cache = WriteScopeCache(model, policy=0.5, backend=backend, **SPEC)
    first = generate(model, ids, mask, cache, 24)
    with pytest.raises(NotImplementedError, match="one query token per sequence"):
        generate(model, ids, mask, cache, 4)  # continuation of a cache that holds tokens
    cache.reset()
    assert cache.kv.usage()["live_sequences"] == 0
    assert torch.equal(generate(model, ids, mask, cache, 24), first)


def test_learned_calibration_starts_the_next_cache_there(backend):
    dev = device_of(backend)
    model = tiny_model("qwen2", device=dev)
    ids, mask = prompts(dev)
    cache = WriteScopeCache(model, policy="roofline", backend=backend, **SPEC)
    with pytest.raises(writescope.StateError, match="no decode step"):
        cache.learned_calibration()  # nothing measured yet
    generate(model, ids, mask, cache, 24)
    learned = cache.learned_calibration()
    assert set(learned) >= {"cpu_cost_per_token_seconds", "gpu_cost_per_token_seconds"}
    assert all(v > 0 and v < 1 for k, v in learned.items() if k != "launch_cost_per_token_seconds")
    # the CPU cost moved off its starting value (it is learned online)
    assert learned["cpu_cost_per_token_seconds"] != writescope.DEFAULT_ROOFLINE["cpu_cost_per_token_seconds"]
    nxt = WriteScopeCache(model, policy="roofline", calibration=learned, max_batch_size=3, backend=backend, **SPEC)
    state = nxt.kv.policy_state()
    for k in ("cpu_cost_per_token_seconds", "gpu_cost_per_token_seconds"):
        assert state[k] == pytest.approx(learned[k], rel=1e-12)
    with pytest.raises(writescope.ConfigError, match="only 'roofline'"):
        WriteScopeCache(model, policy=0.5, backend=backend, **SPEC).learned_calibration()


# --- bad input: an exception naming the value, the cache unchanged -----------------------
def test_unsupported_head_dim_raises_config_error():
    model = tiny_model("llama", head_dim=32)
    with pytest.raises(writescope.ConfigError, match="head dim 32 is not supported; supported: 64, 128, 256"):
        WriteScopeCache(model)


def test_unsupported_mla_latent_raises_config_error():
    model = tiny_model("deepseek_v2", kv_lora_rank=128, qk_rope_head_dim=32)
    with pytest.raises(writescope.ConfigError, match="MLA kv_lora_rank 128 with rope dim 32 is not supported; "
                                                     "supported: 512 with 64"):
        WriteScopeCache(model)


def test_mla_with_q_lora_matches_dynamic_cache(backend):
    """DeepSeek-V2 with a q LoRA (V2 proper; V2-Lite has none): the cache holds the latent rows."""
    dev = device_of(backend)
    model = tiny_model("deepseek_v2_qlora", device=dev)
    ids, mask = prompts(dev)
    ref = reference(model, ids, mask, 40)
    cache = WriteScopeCache(model, policy="roofline", backend=backend, **SPEC)
    assert torch.equal(generate(model, ids, mask, cache, 40), ref)
    assert cache.kv.usage()["num_layers"] == 2 and cache.layout.kind == "mla"


def test_unsupported_kv_dtype_raises_and_leaves_cache_empty(backend):
    dev = device_of(backend)
    model = tiny_model("llama", dtype=torch.float64, device=dev)
    ids, mask = prompts(dev)
    cache = WriteScopeCache(model, backend=backend, max_batch_size=3, **SPEC)
    with pytest.raises(writescope.ShapeError, match="K/V dtype torch.float64 is not supported"):
        generate(model, ids, mask, cache, 4)
    assert cache.kv.usage()["live_sequences"] == 0 and cache.get_seq_length() == 0


def test_cache_reused_across_models_raises(backend):
    dev = device_of(backend)
    a = tiny_model("llama", device=dev)
    b = tiny_model("llama", device=dev, seed=1)
    ids, mask = prompts(dev)
    cache = WriteScopeCache(a, backend=backend, max_batch_size=3, **SPEC)
    with pytest.raises(writescope.StateError, match="outside a forward of the model this cache was built for"):
        generate(b, ids, mask, cache, 4)
    assert cache.kv.usage()["live_sequences"] == 0 and cache.get_seq_length() == 0
    ref = reference(a, ids, mask, 8)
    assert torch.equal(generate(a, ids, mask, cache, 8), ref)  # still serves its own model


def test_capacity_exceeded_at_admission_leaves_cache_unchanged(backend):
    dev = device_of(backend)
    model = tiny_model("mixtral", device=dev)
    ids, mask = prompts(dev)
    # room for the first prompt's batch only (gpu_only: the pinned region): the second is refused
    cache = WriteScopeCache(model, policy="gpu_only", backend=backend, cpu_capacity_tokens=0,
                            pinned_capacity_tokens=32, **SPEC)
    with pytest.raises(writescope.CapacityError, match=r"raise partition_spec::pinned_capacity_tokens\), now 32 tokens"):
        generate(model, ids, mask, cache, 4)
    u = cache.kv.usage()
    assert u["live_sequences"] == 0 and u["pinned_used_blocks"] == 0 and cache.get_seq_length() == 0


def test_capacity_exceeded_at_eviction_raises(backend):
    dev = device_of(backend)
    model = tiny_model("qwen3_moe", device=dev)
    ids, mask = prompts(dev)
    cache = WriteScopeCache(model, policy="cpu_only", backend=backend, cpu_capacity_tokens=96,
                            pinned_capacity_tokens=0, **SPEC)
    with pytest.raises(writescope.CapacityError, match="flush: the full D-window of sequence"):
        generate(model, ids, mask, cache, NEW_TOKENS)
    assert cache.kv.usage()["cpu_used_blocks"] == 96 // 16  # what was placed before stays; nothing half-evicted


def test_decode_needs_the_writescope_attention(backend):
    dev = device_of(backend)
    model = tiny_model("llama", device=dev)
    ids, mask = prompts(dev)
    cache = WriteScopeCache(model, backend=backend, **SPEC)
    model.set_attn_implementation("sdpa")
    with pytest.raises(writescope.ConfigError, match="attention implementation is 'sdpa'"):
        generate(model, ids, mask, cache, 4)


def test_decode_mask_that_hides_the_new_token_raises(backend):
    dev = device_of(backend)
    model = tiny_model("llama", device=dev)
    ids, mask = prompts(dev)
    cache = WriteScopeCache(model, backend=backend, **SPEC)
    model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    step = torch.cat([mask, torch.zeros_like(mask[:, :1])], dim=1)
    with pytest.raises(writescope.ShapeError, match="masks the new token of some row"):
        model(input_ids=ids[:, :1], attention_mask=step, past_key_values=cache)
    with pytest.raises(writescope.ShapeError, match=r"attention mask has shape \(3, 40\), expected \[batch, 41\]"):
        model(input_ids=ids[:, :1], attention_mask=mask, past_key_values=cache)
    assert cache.get_seq_length() == 40 and all(cache.kv.sequence(s)["window_tokens.1"] >= 0 for s in cache._seqs)
    placed = [cache.kv.sequence(s)["placed_tokens"] + cache.kv.sequence(s)["window_tokens.0"] for s in cache._seqs]
    assert placed == mask.sum(dim=1).tolist()  # nothing appended by the refused steps


def test_decode_mask_hiding_the_new_token_on_a_later_step(backend):
    """A CPU mask is read at every decode step: a later step that masks a new token is refused, nothing
    appended. A mask on a device is read on the first decode step after a prompt only (no device
    synchronization per step): the later step goes on, caching and attending that token."""
    dev = device_of(backend)
    model = tiny_model("llama", device=dev)
    ids, mask = prompts(dev)
    cache = WriteScopeCache(model, backend=backend, **SPEC)
    model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    step1 = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    model(input_ids=ids[:, :1], attention_mask=step1, past_key_values=cache)
    step2 = torch.cat([step1, torch.ones_like(mask[:, :1])], dim=1)
    step2[1, -1] = 0
    cached = [cache.kv.sequence(s)["placed_tokens"] + cache.kv.sequence(s)["window_tokens.0"] for s in cache._seqs]
    if dev.type == "cpu":
        with pytest.raises(writescope.ShapeError, match="masks the new token of some row"):
            model(input_ids=ids[:, :1], attention_mask=step2, past_key_values=cache)
        assert cache.get_seq_length() == 41
        after = [cache.kv.sequence(s)["placed_tokens"] + cache.kv.sequence(s)["window_tokens.0"] for s in cache._seqs]
        assert after == cached  # nothing appended by the refused step
    else:
        model(input_ids=ids[:, :1], attention_mask=step2, past_key_values=cache)
        assert cache.get_seq_length() == 42


def test_decode_mask_on_a_device_is_not_read_after_the_first_step(backend):
    """After the first decode step of a prompt, a mask that is not a CPU tensor is checked by shape only:
    a mask on the meta device (whose values cannot be read at all) passes; its wrong shape is still refused;
    a new prompt reads the first step's mask again."""
    dev = device_of(backend)
    model = tiny_model("llama", device=dev)
    ids, mask = prompts(dev)
    cache = WriteScopeCache(model, backend=backend, **SPEC)
    model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    model(input_ids=ids[:, :1], attention_mask=torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1),
          past_key_values=cache)
    cache._forward = torch.ones(3, 42, dtype=torch.long, device="meta")
    cache._check_decode_mask()  # reading a value would raise here
    cache._forward = torch.ones(3, 40, dtype=torch.long, device="meta")
    with pytest.raises(writescope.ShapeError, match=r"attention mask has shape \(3, 40\), expected \[batch, 42\]"):
        cache._check_decode_mask()
    cache.reset()
    model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    cache._forward = torch.ones(3, 41, dtype=torch.long, device="meta")
    with pytest.raises((NotImplementedError, RuntimeError)):
        cache._check_decode_mask()  # the first decode step of the new prompt reads the values
    cache._forward = None
    if dev.type == "cuda":  # and a real device mask after the first step does not synchronize
        cache._check_mask_values = False
        cache._forward = torch.ones(3, 41, dtype=torch.long, device=dev)
        torch.cuda.set_sync_debug_mode("error")
        try:
            cache._check_decode_mask()
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_decode_steps_build_no_mask(backend, monkeypatch):
    """The "writescope" mask function builds transformers' SDPA mask for a prompt and none for a decode step
    over a WriteScopeCache (that would read the padding mask on the device every step); the tokens of a
    ragged batch stay those of DynamicCache (test_greedy_tokens_match_dynamic_cache_fp32)."""
    import writescope.hf as wshf
    dev = device_of(backend)
    model = tiny_model("llama", device=dev)
    ids, mask = prompts(dev)
    built = []
    real = wshf.sdpa_mask
    monkeypatch.setattr(wshf, "sdpa_mask", lambda *a, **k: built.append(k.get("q_length")) or real(*a, **k))
    cache = WriteScopeCache(model, backend=backend, **SPEC)
    model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    assert built == [ids.shape[1]]
    step = mask
    for _ in range(2):
        step = torch.cat([step, torch.ones_like(mask[:, :1])], dim=1)
        model(input_ids=ids[:, :1], attention_mask=step, past_key_values=cache)
    assert built == [ids.shape[1]]  # no mask built for the two decode steps
    assert getattr(wshf._active, "forward", None) is None  # nothing left bound after the forwards
    # outside a WriteScopeCache forward, a one-token query gets the SDPA mask as before
    wshf.writescope_mask(batch_size=1, q_length=1, kv_length=4, device=dev)
    assert built[-1] == 1


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_hbm_region_gives_the_same_tokens(arch, backend):
    """hbm_capacity_tokens: the prompts' first batches go to the HBM-resident region (attended in place),
    the rest to the host regions; generate() gives the tokens it gives without the region, and split()
    counts the HBM tokens apart."""
    dev = device_of(backend)
    model = tiny_model(arch, device=dev)
    ids, mask = prompts(dev)
    plain = WriteScopeCache(model, policy=0.5, backend=backend, **SPEC)
    ref = generate(model, ids, mask, plain)
    cache = WriteScopeCache(model, policy=0.5, backend=backend, hbm_capacity_tokens=2 * 32, **SPEC)
    out = generate(model, ids, mask, cache)
    assert torch.equal(out, ref), f"first differing positions: {(out != ref).nonzero()[:4].tolist()}"
    split, before = cache.split(), plain.split()
    assert split["hbm_tokens"] == 2 * 32 and before["hbm_tokens"] == 0
    assert split["cpu_tokens"] + split["pinned_tokens"] + split["hbm_tokens"] == \
        before["cpu_tokens"] + before["pinned_tokens"]
    hbm = [cache.kv.sequence(s)["hbm_placed_tokens"] for s in cache._seqs]
    pinned = [cache.kv.sequence(s)["pinned_placed_tokens"] for s in cache._seqs]
    assert sum(hbm) == split["hbm_tokens"] and sum(pinned) == split["pinned_tokens"]


@pytest.mark.parametrize("tokens", [48, -32])
def test_hbm_capacity_not_whole_batches_raises_at_construction(tokens):
    model = tiny_model("llama")
    with pytest.raises(writescope.ConfigError, match=rf"hbm_capacity_tokens = {tokens} must be >= 0 and a whole "
                                                     r"number of eviction batches \(a multiple of d_window_tokens = 32\)"):
        WriteScopeCache(model, backend="host", hbm_capacity_tokens=tokens, **SPEC)


def test_wrong_mask_shape_raises(backend):
    dev = device_of(backend)
    model = tiny_model("llama", device=dev)
    ids, mask = prompts(dev)
    cache = WriteScopeCache(model, backend=backend, max_batch_size=3, **SPEC)
    with pytest.raises(writescope.ShapeError, match=r"attention mask of shape \(3, 39\) for a prompt batch of 3 x 40"):
        model(input_ids=ids, attention_mask=mask[:, 1:], past_key_values=cache)
    assert cache.kv.usage()["live_sequences"] == 0
