# SPDX-License-Identifier: Apache-2.0
"""The torch ops of writescope.KVCache against a float64 reference, and their errors."""

import math

import pytest
import torch

import writescope as ws

from conftest import device_of


def reference(keys, values, q, scale, group):
    """Attention of one query row set over all cached tokens, float64. keys [T, Hkv, D]."""
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    s = torch.einsum("hd,thd->ht", q.double(), k) * scale
    return torch.einsum("ht,thd->hd", s.softmax(-1), v), torch.logsumexp(s, -1)


def make(layout, backend, r=0.5, layers=2, **kw):
    spec = dict(max_sequences=4, cpu_capacity_tokens=4096, pinned_capacity_tokens=4096, block_tokens=16,
                d_window_tokens=32, ping_pong_bytes=1 << 20, cpu_threads=1)
    spec.update(kw)
    return ws.KVCache(layout, layers, policy=r, backend=backend, **spec)


@pytest.mark.parametrize("r", [0.0, 0.5, 1.0, "roofline"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gqa_decode_matches_reference(head_dim, r, backend):
    dev = device_of(backend)
    lay = ws.gqa(8, 2, head_dim)
    cache = make(lay, backend, r=r)
    torch.manual_seed(0)
    prompts = [70, 5, 33]
    seqs = [cache.begin_sequence(p) for p in prompts]
    kv = {}  # (layer, seq) -> (K, V) as cached (bf16)
    for layer in range(2):
        for s, p in zip(seqs, prompts):
            k = torch.randn(p, 2, head_dim).bfloat16()
            v = torch.randn(p, 2, head_dim).bfloat16()
            cache.append_prefill(layer, s, k.to(dev), v.to(dev))
            kv[layer, s] = (k, v)
    scale = 1 / math.sqrt(head_dim)
    for step in range(40):
        q = torch.randn(3, 8, head_dim)
        for layer in range(2):
            k = torch.randn(3, 2, head_dim).bfloat16()
            v = torch.randn(3, 2, head_dim).bfloat16()
            cache.append(layer, seqs, k.to(dev), v.to(dev))
            out, lse = cache.attention(layer, seqs, q.to(dev), scale)
            for i, s in enumerate(seqs):
                K, V = kv[layer, s]
                kv[layer, s] = (torch.cat([K, k[i:i + 1]]), torch.cat([V, v[i:i + 1]]))
                ro, rl = reference(*kv[layer, s], q[i], scale, 4)
                assert torch.allclose(out[i].cpu().double(), ro, atol=2e-5, rtol=1e-4), (step, layer, i)
                assert torch.allclose(lse[i].cpu().double(), rl, atol=2e-5, rtol=1e-5)
        cache.flush()
    split = cache.split()
    if r == 0.0:
        assert split["cpu_tokens"] == 0 and split["pinned_tokens"] > 0
    elif r == 1.0:
        assert split["pinned_tokens"] == 0 and split["cpu_tokens"] > 0
    else:
        assert split["cpu_tokens"] > 0 and split["pinned_tokens"] > 0
    # placed + window tokens account for every token of every sequence
    for s, p in zip(seqs, prompts):
        st = cache.sequence(s)
        assert st["placed_tokens"] + st["window_tokens.1"] == p + 40


def test_all_gpu_steps_skip_the_cpu_side_with_the_same_bits(backend):
    """gpu_only places no CPU block: every step runs without a CPU side (last_step()["cpu_side"] 0)
    unless all_gpu_steps=0, which runs it in every step; the outputs are the same bits."""
    dev = device_of(backend)
    lay = ws.gqa(8, 2, 64)
    outs = {}
    for flag in (1, 0):
        cache = make(lay, backend, r=0.0, layers=1, all_gpu_steps=flag)
        torch.manual_seed(3)
        seqs = [cache.begin_sequence(p) for p in (70, 33)]
        for s, p in zip(seqs, (70, 33)):
            cache.append_prefill(0, s, torch.randn(p, 2, 64).bfloat16().to(dev), torch.randn(p, 2, 64).bfloat16().to(dev))
        q = torch.randn(2, 8, 64).to(dev)
        out, lse = cache.attention(0, seqs, q, 0.125)
        assert cache.last_step()["cpu_side"] == (0 if flag else 1)
        assert cache.last_step()["cpu_tasks"] == 0
        outs[flag] = (out.cpu(), lse.cpu())
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_mla_decode_matches_reference(backend):
    """MLA (absorbed): one latent row of 512 + 64 per token; V is its first 512 elements."""
    dev = device_of(backend)
    lay = ws.mla(4)
    cache = make(lay, backend, r=0.5, layers=1, cpu_capacity_tokens=1024, pinned_capacity_tokens=1024,
                 ping_pong_bytes=4 << 20)
    torch.manual_seed(0)
    seq = cache.begin_sequence(45)
    rows = torch.randn(45, 1, 576).bfloat16()
    cache.append_prefill(0, seq, rows.to(dev))
    scale = 0.07
    for step in range(30):
        new = torch.randn(1, 1, 576).bfloat16()
        cache.append(0, [seq], new.to(dev))
        rows = torch.cat([rows, new])
        q = torch.randn(1, 4, 576)
        out, lse = cache.attention(0, [seq], q.to(dev), scale)
        k = rows[:, 0].double()
        s = (q[0].double() @ k.T) * scale
        ro = s.softmax(-1) @ k[:, :512]
        assert out.shape == (1, 4, 512)
        assert torch.allclose(out[0].cpu().double(), ro, atol=1e-4, rtol=1e-3), step
        assert torch.allclose(lse[0].cpu().double(), torch.logsumexp(s, -1), atol=1e-4)
        cache.flush()
    assert cache.split()["cpu_tokens"] > 0 and cache.split()["pinned_tokens"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_attention_from_the_model_query_matches_float64(dtype, backend):
    """KVCache.mla_attention (one op: absorb W_UK into the query, attend the latent rows, apply W_UV)
    against the unabsorbed float64 reference: per head, K = [W_UK c ‖ k_pe] and V = W_UV c over the cached
    rows; bad weights raise ShapeError naming the shape and leave the cache as it was."""
    dev = device_of(backend)
    heads, nope, rope, rank, v_dim = 4, 32, 64, 512, 48
    cache = make(ws.mla(heads), backend, r=0.5, layers=1, cpu_capacity_tokens=1024, pinned_capacity_tokens=1024,
                 ping_pong_bytes=4 << 20)
    torch.manual_seed(3)
    w_uk = torch.randn(heads, nope, rank) * 0.05
    w_uv_t = torch.randn(heads, rank, v_dim) * 0.05
    seq = cache.begin_sequence(70)
    rows = torch.randn(70, 1, rank + rope).bfloat16()
    cache.append_prefill(0, seq, rows.to(dev))
    scale = 0.09
    for step in range(3):
        new = torch.randn(1, 1, rank + rope).bfloat16()
        cache.append(0, [seq], new.to(dev))
        rows = torch.cat([rows, new])
        query = torch.randn(1, heads, 1, nope + rope).to(dtype)
        out = cache.mla_attention(0, [seq], query.to(dev), w_uk.to(dev), w_uv_t.to(dev), scale)
        assert out.shape == (1, 1, heads, v_dim) and out.dtype == dtype
        c, k_pe = rows[:, 0, :rank].double(), rows[:, 0, rank:].double()
        q = query[0, :, 0].double()
        for h in range(heads):
            k = torch.cat([c @ w_uk[h].double().T, k_pe], dim=-1)  # [T, nope + rope]
            p = ((k @ q[h]) * scale).softmax(-1)
            ref = p @ (c @ w_uv_t[h].double())
            tol = 2e-4 if dtype == torch.float32 else 2e-2
            assert torch.allclose(out[0, 0, h].cpu().double(), ref, atol=tol, rtol=tol), (step, h)
        cache.flush()
    before = cache.sequence(seq)
    q = torch.randn(1, heads, 1, nope + rope).to(dev)
    with pytest.raises(ws.ShapeError, match=r"w_uk \[4, 96, 512\] \(Float\) is not float32 \[4, nope < 96"):
        cache.mla_attention(0, [seq], q, torch.zeros(heads, nope + rope, rank).to(dev), w_uv_t.to(dev), scale)
    with pytest.raises(ws.ShapeError, match=r"q"):  # a rank other than the cache's: the latent query's width
        cache.mla_attention(0, [seq], q, w_uk[:, :, :500].contiguous().to(dev), w_uv_t[:, :500].contiguous().to(dev),
                            scale)
    with pytest.raises(ws.ShapeError, match=r"w_uv_t \[4, 512, 48\] \(BFloat16\)"):
        cache.mla_attention(0, [seq], q, w_uk.to(dev), w_uv_t.bfloat16().to(dev), scale)
    with pytest.raises(ws.ShapeError, match=r"query \[1, 4, 2, 96\]"):
        cache.mla_attention(0, [seq], torch.randn(1, heads, 2, nope + rope).to(dev), w_uk.to(dev), w_uv_t.to(dev),
                            scale)
    assert cache.sequence(seq) == before


def test_strided_kv_is_taken_as_is(backend):
    """K/V as views of a fused [tokens, 2, kv_heads, D] buffer (a token stride) are read correctly."""
    dev = device_of(backend)
    lay = ws.gqa(4, 2, 64)
    cache = make(lay, backend, layers=1)
    torch.manual_seed(3)
    fused = torch.randn(50, 2, 2, 64).bfloat16().to(dev)
    s = cache.begin_sequence(50)
    cache.append_prefill(0, s, fused[:, 0], fused[:, 1])
    for pos in (0, 31, 32, 49):
        got = cache.read_token(0, s, pos)
        assert torch.equal(got[0], fused[pos, 0].cpu()) and torch.equal(got[1], fused[pos, 1].cpu())


# --- errors: the library's exceptions, as Python exceptions naming the value -------------
def test_errors_name_the_value(backend):
    dev = device_of(backend)
    lay = ws.gqa(4, 2, 64)
    with pytest.raises(ws.ConfigError, match="head dim 96 is not supported; supported: 64, 128, 256"):
        make(ws.gqa(4, 2, 96), backend)
    with pytest.raises(ws.ConfigError, match="Hq=6 is not a multiple of Hkv=4"):
        make(ws.gqa(6, 4, 64), backend)
    with pytest.raises(ws.ConfigError, match=r"D \(d_window_tokens\) 40 is not a positive multiple of the block size 16"):
        make(lay, backend, d_window_tokens=40)
    with pytest.raises(ws.ConfigError, match="fixed_ratio: CPU share 1.5 is outside"):
        make(lay, backend, r=1.5)
    with pytest.raises(ws.ConfigError, match="unknown option 'gpu_splits'"):
        make(lay, backend, gpu_splits=4)
    cache = make(lay, backend, layers=1)
    s = cache.begin_sequence(40)
    k = torch.randn(40, 2, 64).bfloat16().to(dev)
    before = cache.sequence(s)
    with pytest.raises(ws.ShapeError, match="append_prefill: k has dtype Float, expected BFloat16"):
        cache.append_prefill(0, s, k.float(), k)
    with pytest.raises(ws.ShapeError, match=r"append_prefill: v has shape \[39, 2, 64\], expected \[40, 2, 64\]"):
        cache.append_prefill(0, s, k, k[:39])
    with pytest.raises(ws.ShapeError, match="append_prefill: layer 3 outside"):
        cache.append_prefill(3, s, k, k)
    assert cache.sequence(s) == before  # nothing written
    cache.append_prefill(0, s, k, k)
    with pytest.raises(ws.StateError, match="already holds its prompt"):
        cache.append_prefill(0, s, k, k)
    q = torch.randn(1, 4, 64).to(dev)
    with pytest.raises(ws.ShapeError, match="sequence 7 is not a live sequence"):
        cache.attention(0, [7], q, 0.1)
    with pytest.raises(ws.ConfigError, match="softmax scale -1.000000 must be finite and positive"):
        cache.attention(0, [s], q, -1.0)
    with pytest.raises(ws.CapacityError, match=r"a prompt of 100000 tokens .*capacity exceeded; raise partition_spec::(cpu|pinned)_capacity_tokens\)"):
        cache.begin_sequence(10**5)
    assert cache.usage()["live_sequences"] == 1
    if not ws.cuda_built():
        with pytest.raises(ws.ConfigError, match="no CUDA backend"):
            make(lay, "cuda")
    elif not torch.cuda.is_available():
        with pytest.raises(ws.CudaError, match="^no CUDA device: cudaGetDeviceCount"):
            make(lay, "cuda")


def test_cpu_prefault_tokens_makes_the_unpinned_region_resident(backend):
    """cpu_prefault_tokens: -1 the whole unpinned region, n its first ceil(n / block) blocks, 0 none;
    below -1 refused naming the value. The bytes are every layer's blocks made resident."""
    lay = ws.gqa(4, 2, 64)
    block_bytes = 16 * lay.token_bytes
    whole = make(lay, backend, layers=2, cpu_prefault_tokens=-1).usage()
    assert whole["cpu_prefaulted_bytes"] == whole["cpu_capacity_blocks"] * block_bytes * 2
    assert make(lay, backend, layers=2, cpu_prefault_tokens=40).usage()["cpu_prefaulted_bytes"] == 3 * block_bytes * 2
    assert make(lay, backend, layers=2).usage()["cpu_prefaulted_bytes"] == 0
    with pytest.raises(ws.ConfigError, match=r"cpu_prefault_tokens = -2 must be >= -1"):
        make(lay, backend, cpu_prefault_tokens=-2)


@pytest.mark.parametrize("resident_kernel", [0, 1])
def test_hbm_region_attends_right_and_is_counted_apart(resident_kernel, backend):
    """hbm_capacity_tokens: the policies fill the HBM-resident region first (whole D-token batches), the
    rest goes to the host regions; attention over all three plus the D-window matches the float64
    reference; usage/sequence/split count HBM tokens apart from the pinned ones. resident_kernel=1:
    the same through the split-K resident kernels (CUDA backend; the host backend ignores it)."""
    dev = device_of(backend)
    lay = ws.gqa(8, 2, 64)
    cache = make(lay, backend, r=0.5, layers=1, hbm_capacity_tokens=3 * 32, resident_kernel=resident_kernel)
    u = cache.usage()
    assert u["hbm_capacity_blocks"] == 3 * 2 and u["hbm_used_blocks"] == 0
    assert u["hbm_region_bytes"] == 3 * 32 * lay.token_bytes  # one layer
    torch.manual_seed(5)
    prompts = [100, 70, 40]  # 3 + 2 + 1 whole batches: 3 of them fill the region, 3 go to the host
    seqs = [cache.begin_sequence(p) for p in prompts]
    kv = {}
    for s, p in zip(seqs, prompts):
        k, v = torch.randn(p, 2, 64).bfloat16(), torch.randn(p, 2, 64).bfloat16()
        cache.append_prefill(0, s, k.to(dev), v.to(dev))
        kv[s] = (k, v)
    scale = 0.125
    for step in range(40):
        q = torch.randn(3, 8, 64)
        k, v = torch.randn(3, 2, 64).bfloat16(), torch.randn(3, 2, 64).bfloat16()
        cache.append(0, seqs, k.to(dev), v.to(dev))
        out, lse = cache.attention(0, seqs, q.to(dev), scale)
        for i, s in enumerate(seqs):
            kv[s] = (torch.cat([kv[s][0], k[i:i + 1]]), torch.cat([kv[s][1], v[i:i + 1]]))
            ro, rl = reference(*kv[s], q[i], scale, 4)
            assert torch.allclose(out[i].cpu().double(), ro, atol=2e-5, rtol=1e-4), (step, i)
            assert torch.allclose(lse[i].cpu().double(), rl, atol=2e-5, rtol=1e-5)
        if step == 0:
            assert cache.last_step()["resident_tokens"] == 3 * 32
        cache.flush()
    split = cache.split()
    states = [cache.sequence(s) for s in seqs]
    assert split["hbm_tokens"] == 3 * 32 == cache.usage()["total_hbm_placed_tokens"]
    assert sum(st["hbm_placed_tokens"] for st in states) == split["hbm_tokens"]
    assert sum(st["pinned_placed_tokens"] for st in states) == split["pinned_tokens"]
    assert sum(st["cpu_placed_tokens"] for st in states) == split["cpu_tokens"]
    assert split["cpu_tokens"] > 0 and split["pinned_tokens"] > 0
    assert split["cpu_share"] == split["cpu_tokens"] / (split["cpu_tokens"] + split["pinned_tokens"])
    for st, p in zip(states, prompts):
        assert st["cpu_placed_tokens"] + st["pinned_placed_tokens"] + st["hbm_placed_tokens"] == st["placed_tokens"]
        assert st["placed_tokens"] + st["window_tokens.0"] == p + 40


def test_roofline_measures_h_from_steps_that_stream_nothing(backend):
    """The roofline's H (GPU seconds per HBM-resident token) starts at the calibration's value and,
    with track_hbm_cost (the default), is re-measured from the steps whose GPU side streamed nothing;
    track_hbm_cost=0 keeps it."""
    dev = device_of(backend)
    lay = ws.gqa(8, 2, 64)
    prior = 1.0  # one second per token: no measurement comes near it
    cal = {"cpu_cost_per_token_seconds": 2e-8, "gpu_cost_per_token_seconds": 3e-8, "hbm_cost_per_token_seconds": prior}
    got = {}
    for track in (1, 0):
        cache = make(lay, backend, r="roofline", layers=1, hbm_capacity_tokens=4 * 32, calibration=cal,
                     track_hbm_cost=track)
        assert cache.policy_state()["hbm_cost_per_token_seconds"] == prior
        seq = cache.begin_sequence(64)  # two whole batches: both to the region, which has room for four
        cache.append_prefill(0, seq, torch.randn(64, 2, 64).bfloat16().to(dev), torch.randn(64, 2, 64).bfloat16().to(dev))
        for _ in range(4):
            cache.append(0, [seq], torch.randn(1, 2, 64).bfloat16().to(dev), torch.randn(1, 2, 64).bfloat16().to(dev))
            cache.attention(0, [seq], torch.randn(1, 8, 64).to(dev), 0.125)
            cache.flush()
        assert cache.split()["hbm_tokens"] == 64 and cache.last_step()["streamed_tokens"] == 0
        got[track] = cache.policy_state()["hbm_cost_per_token_seconds"]
    assert 0 < got[1] < 1e-2, got
    assert got[0] == prior


@pytest.mark.parametrize("tokens", [40, -32, 1])
def test_hbm_capacity_not_whole_batches_is_refused(tokens, backend):
    with pytest.raises(ws.ConfigError, match=rf"hbm_capacity_tokens = {tokens} must be >= 0 and a whole number of "
                                             r"eviction batches \(a multiple of d_window_tokens = 32\)"):
        make(ws.gqa(4, 2, 64), backend, hbm_capacity_tokens=tokens)
    assert make(ws.gqa(4, 2, 64), backend, hbm_capacity_tokens=0).usage()["hbm_capacity_blocks"] == 0


def test_error_classes_are_python_exceptions():
    assert issubclass(ws.ConfigError, ValueError) and issubclass(ws.ShapeError, ValueError)
    assert issubclass(ws.StateError, RuntimeError) and issubclass(ws.CapacityError, RuntimeError)
    assert issubclass(ws.PinnedMemoryError, ws.ResourceError)
    for c in (ws.ConfigError, ws.ShapeError, ws.StateError, ws.CapacityError, ws.CudaError):
        assert issubclass(c, ws.Error)


def test_build_info_says_whether_cuda_was_built():
    info = ws.build_info()
    assert "CUDA backend: built" in info if ws.cuda_built() else "CUDA backend: not built" in info
