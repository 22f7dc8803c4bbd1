# SPDX-License-Identifier: Apache-2.0
"""The batched prefill (KVCache.append_prefill_batch, one backend write per layer) against
one append_prefill per sequence, its refusals, WriteScopeCache's use of it (each row's
tokens where they belong, for left-padded and holed masks), and the CUDA backend's deferred
pageable prefill writes (deferred_host_write_bytes) against synchronous ones."""

import pytest
import torch

import writescope as ws
from writescope.hf import WriteScopeCache

from conftest import device_of, tiny_model

SPEC = dict(max_sequences=4, cpu_capacity_tokens=4096, pinned_capacity_tokens=4096, block_tokens=16,
            d_window_tokens=32, ping_pong_bytes=1 << 20, cpu_threads=1)


def make(layout, backend, layers=2, r=0.5, **kw):
    spec = dict(SPEC)
    spec.update(kw)
    return ws.KVCache(layout, layers, policy=r, backend=backend, **spec)


def cached(cache, layers, seqs, lengths):
    """Every cached token of every sequence, as read back: {(layer, seq): [tokens, planes, heads, row]}."""
    return {(l, s): torch.stack([cache.read_token(l, s, p) for p in range(n)]) if n else None
            for l in range(layers) for s, n in zip(seqs, lengths)}


LAYOUTS = {"gqa": (ws.gqa(8, 2, 64), 2, 64), "mla": (ws.mla(4), 1, 576)}


@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("r", [0.0, 0.5, 1.0])
def test_batch_equals_per_sequence(kind, r, backend):
    """The same bytes and placement as append_prefill per sequence: prompts packed out of order with
    gaps between them (first tokens not multiples of anything), one shorter than a block."""
    dev = device_of(backend)
    lay, heads, row = LAYOUTS[kind]
    planes = lay.planes
    lengths = [70, 5, 16, 33]
    torch.manual_seed(0)
    one, batch = make(lay, backend, r=r), make(lay, backend, r=r)
    seqs = [one.begin_sequence(n) for n in lengths]
    assert [batch.begin_sequence(n) for n in lengths] == seqs
    order = [3, 0, 2, 1]  # the packing order: the sequences' prompts are not in id order
    for layer in range(2):
        buf = torch.randn(200, planes, heads, row).bfloat16().to(dev)
        firsts, at = {}, 3
        for i in order:
            firsts[i] = at
            at += lengths[i] + 7  # a gap of 7 tokens nobody owns
        for i, s in enumerate(seqs):
            rows = buf[firsts[i]:firsts[i] + lengths[i]]
            one.append_prefill(layer, s, *(rows[:, p] for p in range(planes)))
        batch.append_prefill_batch(layer, [seqs[i] for i in order], [firsts[i] for i in order],
                                   *(buf[:, p] for p in range(planes)))
    for s in seqs:
        assert batch.sequence(s) == one.sequence(s)
    a, b = cached(one, 2, seqs, lengths), cached(batch, 2, seqs, lengths)
    for key in a:
        assert (a[key] is None and b[key] is None) or torch.equal(a[key], b[key]), key
    assert batch.split() == one.split()
    # and decoding on from either gives the same outputs, bit for bit
    live = [s for s, n in zip(seqs, lengths)]
    for step in range(3):
        q = torch.randn(len(live), lay.num_q_heads, lay.q_dim).to(dev)
        new = torch.randn(len(live), planes, heads, row).bfloat16().to(dev)
        for layer in range(2):
            outs = []
            for c in (one, batch):
                c.append(layer, live, *(new[:, p] for p in range(planes)))
                outs.append(c.attention(layer, live, q, 0.1))
            assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), (step, layer)
        one.flush()
        batch.flush()


def test_batch_refusals_leave_the_cache_unchanged(backend):
    dev = device_of(backend)
    lay = ws.gqa(4, 2, 64)
    cache = make(lay, backend, layers=1)
    a, b = cache.begin_sequence(40), cache.begin_sequence(20)
    k = torch.randn(60, 2, 64).bfloat16().to(dev)
    before = (cache.sequence(a), cache.sequence(b), cache.usage())
    with pytest.raises(ws.ShapeError, match="append_prefill: 2 sequences but 1 first tokens"):
        cache.append_prefill_batch(0, [a, b], [0], k, k)
    with pytest.raises(ws.ShapeError, match=f"append_prefill: sequence {a} appears twice"):
        cache.append_prefill_batch(0, [a, a], [0, 20], k, k)
    with pytest.raises(ws.ShapeError, match=f"sequence {b}'s prompt of 20 tokens from token 41 lies outside the 60 "):
        cache.append_prefill_batch(0, [a, b], [0, 41], k, k)
    with pytest.raises(ws.ShapeError, match=f"sequence {a}'s prompt of 40 tokens from token -1 lies outside"):
        cache.append_prefill_batch(0, [a, b], [-1, 40], k, k)
    with pytest.raises(ws.ShapeError, match="sequence 3 is not a live sequence"):
        cache.append_prefill_batch(0, [a, 3], [0, 40], k, k)
    with pytest.raises(ws.ShapeError, match="append_prefill: layer 1 outside"):
        cache.append_prefill_batch(1, [a, b], [0, 40], k, k)
    with pytest.raises(ws.ShapeError, match=r"append_prefill_batch: v has shape \[59, 2, 64\], expected \[60, 2, 64\]"):
        cache.append_prefill_batch(0, [a, b], [0, 40], k, k[:59])
    with pytest.raises(ws.ShapeError, match="append_prefill_batch: k has dtype Float, expected BFloat16"):
        cache.append_prefill_batch(0, [a, b], [0, 40], k.float(), k)
    with pytest.raises(ws.ShapeError, match="append_prefill_batch: a GQA cache needs v"):
        cache.append_prefill_batch(0, [a, b], [0, 40], k)
    assert (cache.sequence(a), cache.sequence(b), cache.usage()) == before  # nothing written
    cache.append_prefill_batch(0, [a, b], [0, 40], k, k)  # the valid call exactly at the end of k
    got = cache.read_token(0, b, 19)
    assert torch.equal(got[0], k[59].cpu()) and torch.equal(got[1], k[59].cpu())
    with pytest.raises(ws.StateError, match="already holds its prompt"):
        cache.append_prefill_batch(0, [b], [0], k, k)


# --- WriteScopeCache: one batched write per layer, each row's kept tokens in its sequence ---
def capture_prefill_kv(cache):
    """Wraps cache.update to keep each layer's prompt K/V as the model handed it over."""
    seen = {}
    orig = cache.update

    def update(key_states, value_states, layer_idx, *a, **k):
        if key_states.shape[2] > 1:
            seen[layer_idx] = (key_states.detach().clone(), value_states.detach().clone())
        return orig(key_states, value_states, layer_idx, *a, **k)

    cache.update = update
    return seen


MASKS = {
    "none": None,
    "left": [[0] * 7 + [1] * 33, [1] * 40, [0] * 18 + [1] * 22],
    "holes": [[0] * 7 + [1] * 33, [1] * 10 + [0] * 5 + [1] * 25, [0] * 3 + [1] * 30 + [0] * 2 + [1] * 5],
}


@pytest.mark.parametrize("mask_kind", list(MASKS))
@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v2"])
def test_prefill_rows_land_in_their_sequences(arch, mask_kind, backend):
    """After a prompt forward, every row's kept positions are its sequence's tokens 0.. in order,
    bit for bit the K/V the model computed (bf16), in every layer; the placement is that of a
    prompt of the row's kept length (as begin_sequence + append_prefill of that row alone)."""
    dev = device_of(backend)
    model = tiny_model(arch, device=dev)
    torch.manual_seed(2)
    ids = torch.randint(3, 256, (3, 40), device=dev)
    mask = None if MASKS[mask_kind] is None else torch.tensor(MASKS[mask_kind], device=dev)
    cache = WriteScopeCache(model, policy=0.5, backend=backend, block_tokens=16, d_window_tokens=32, cpu_threads=1)
    seen = capture_prefill_kv(cache)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    keep = torch.ones(3, 40, dtype=torch.bool) if mask is None else mask.bool().cpu()
    for layer, (k, v) in seen.items():
        for row, s in enumerate(cache._seqs):
            pos = keep[row].nonzero().flatten().tolist()
            st = cache.kv.sequence(s)
            assert st["prompt_tokens"] == len(pos)
            for j, p in enumerate(pos):
                got = cache.kv.read_token(layer, s, j)
                if cache.layout.kind == "gqa":
                    want = torch.stack([k[row, :, p], v[row, :, p]]).to(torch.bfloat16).cpu()
                else:
                    want = torch.cat([k[row, :, p], v[row, :, p]], dim=-1)[None].to(torch.bfloat16).cpu()
                assert torch.equal(got, want), (layer, row, j)
    assert len(seen) == model.config.num_hidden_layers


def test_one_batched_write_per_layer(backend):
    """WriteScopeCache's prefill calls the batched op once per layer (no per-sequence appends)."""
    dev = device_of(backend)
    model = tiny_model("qwen3_moe", device=dev)
    ids = torch.randint(3, 256, (3, 40), device=dev)
    mask = torch.tensor(MASKS["left"], device=dev)
    cache = WriteScopeCache(model, policy=0.5, backend=backend, max_batch_size=3, block_tokens=16,
                            d_window_tokens=32, cpu_threads=1)
    calls = []
    for name in ("append_prefill", "append_prefill_batch"):
        orig = getattr(cache.kv, name)
        setattr(cache.kv, name, lambda *a, _o=orig, _n=name, **k: (calls.append((_n, a[0])), _o(*a, **k))[1])
    model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2,
                   min_new_tokens=2, do_sample=False, pad_token_id=0)
    assert calls == [("append_prefill_batch", l) for l in range(model.config.num_hidden_layers)]


# --- deferred pageable prefill writes (CUDA backend) ------------------------------------
def test_deferred_writes_option_on_the_host_backend():
    """The host backend takes the option and has nothing to defer (usage reports 0)."""
    cache = make(ws.gqa(4, 2, 64), "host", deferred_host_write_bytes=1 << 20, staging_bytes=1 << 20)
    assert cache.usage()["deferred_host_write_bytes"] == 0
    cache.complete_writes()


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_deferred_writes_equal_synchronous_writes_cuda(kind, backend):
    """KVCache on CUDA: the prompts' bytes read back (read_token completes pending writes) and the
    decode outputs are bit for bit those of synchronous writes, for a buffer that holds a layer, one
    that holds less than a block (direct copies) and the default; errors name the value."""
    if backend != "cuda":
        pytest.skip("deferred pageable writes exist on the CUDA backend only")
    dev = device_of(backend)
    lay, heads, row = LAYOUTS[kind]
    planes = lay.planes
    with pytest.raises(ws.ConfigError, match="deferred_host_write_bytes = -1 must be >= 0"):
        make(lay, backend, deferred_host_write_bytes=-1)
    lengths = [70, 5, 33]
    results = []
    for deferred in (0, 64 << 20, 1000, None):
        torch.manual_seed(0)
        opts = {} if deferred is None else {"deferred_host_write_bytes": deferred}
        cache = make(lay, backend, r=1.0, **opts)  # every placed block in the unpinned (pageable) region
        assert cache.usage()["deferred_host_write_bytes"] == (512 << 20 if deferred is None else deferred)
        seqs = [cache.begin_sequence(n) for n in lengths]
        for layer in range(2):
            buf = torch.randn(sum(lengths), planes, heads, row).bfloat16().to(dev)
            firsts = [sum(lengths[:i]) for i in range(len(lengths))]
            cache.append_prefill_batch(layer, seqs, firsts, *(buf[:, p] for p in range(planes)))
        outs = []
        for step in range(40):
            q = torch.randn(3, lay.num_q_heads, lay.q_dim).to(dev)
            new = torch.randn(3, planes, heads, row).bfloat16().to(dev)
            for layer in range(2):
                cache.append(layer, seqs, *(new[:, p] for p in range(planes)))
                outs.append(cache.attention(layer, seqs, q, 0.1))
            cache.flush()
        assert cache.split()["cpu_tokens"] > 0
        results.append((cached(cache, 2, seqs, [n + 40 for n in lengths]), outs))
    ref_bytes, ref_outs = results[0]
    for got_bytes, got_outs in results[1:]:
        for key in ref_bytes:
            assert torch.equal(ref_bytes[key], got_bytes[key]), key
        for (a, la), (b, lb) in zip(ref_outs, got_outs):
            assert torch.equal(a, b) and torch.equal(la, lb)


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v2"])
def test_generate_with_deferred_writes_equals_synchronous_cuda(arch, backend):
    """generate() on CUDA with deferred pageable prefill writes (the default) gives the tokens and
    the cached bytes of synchronous writes (deferred_host_write_bytes=0), bit for bit; after
    generate() nothing is pending, also with the prompt alone (max_new_tokens=1: no decode step)."""
    if backend != "cuda":
        pytest.skip("deferred pageable writes exist on the CUDA backend only")
    dev = device_of(backend)
    model = tiny_model(arch, device=dev, dtype=torch.bfloat16)
    ids = torch.randint(3, 256, (3, 40), device=dev)
    mask = torch.tensor(MASKS["left"], device=dev)
    outs, reads = [], []
    for opts in ({"deferred_host_write_bytes": 0}, {}, {"deferred_host_write_bytes": 4096}):
        for new in (1, 24):
            cache = WriteScopeCache(model, policy=1.0, backend=backend, block_tokens=16, d_window_tokens=32,
                                    cpu_threads=1, **opts)
            out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, pad_token_id=0)
            outs.append(out)
            if new == 1:  # the prompt only: its last layer's writes completed at the end of the forward
                assert not cache._writes_pending
                n = [int(x) for x in mask.sum(1)]
                reads.append(cached(cache.kv, model.config.num_hidden_layers, cache._seqs, n))
    for j in range(2, len(outs)):  # outs: (1 token, 24 tokens) per option; the first option's are the reference
        assert torch.equal(outs[j], outs[j % 2]), j
    for r in reads[1:]:
        for key in reads[0]:
            assert torch.equal(reads[0][key], r[key]), key


def test_host_copy_counters(backend):
    """usage()'s host_copy_* keys: zero on the host backend; on the CUDA backend a prefill split
    between the pinned and the unpinned region is copied device to host in pieces, and the CUDA
    calls that issue them are at most the pieces (one per staging group where the batch call exists)."""
    dev = device_of(backend)
    lay, heads, row = LAYOUTS["gqa"]
    cache = make(lay, backend, r=0.5)
    before = cache.usage()
    seqs = [cache.begin_sequence(n) for n in (300, 200)]
    buf = torch.randn(500, 2, heads, row).bfloat16().to(dev)
    for layer in range(2):
        cache.append_prefill_batch(layer, seqs, [0, 300], buf[:, 0], buf[:, 1])
    cache.complete_writes()
    after = cache.usage()
    keys = ("host_copy_submissions", "host_copy_pieces", "host_copy_api_calls")
    delta = {k: after[k] - before[k] for k in keys}
    if backend == "host":
        assert all(after[k] == 0 for k in keys), after
    else:
        split = cache.split()
        assert split["cpu_tokens"] > 0 and split["pinned_tokens"] > 0, split
        assert delta["host_copy_submissions"] >= 2, delta  # at least one per layer
        assert 1 <= delta["host_copy_api_calls"] <= delta["host_copy_pieces"], delta
