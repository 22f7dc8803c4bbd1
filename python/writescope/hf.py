# SPDX-License-Identifier: Apache-2.0
"""writescope under HF transformers: ``WriteScopeCache`` and the "writescope" attention.

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="writescope")
    cache = WriteScopeCache(model, policy="roofline", max_batch_size=4, max_cache_len=8192)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=256)

``WriteScopeCache.update()`` writes each layer's K/V into one ``writescope.KVCache``: the
prompt at write time to its final regions (whole D-token batches routed by the policy,
the rest into the D-window), each decode token into the D-window. The attention function
registered as "writescope" runs the model's own SDPA for prompts and writescope's
hybrid decode attention (CPU and GPU at once, merged by LSE) for decode steps; after the
last layer of a step the cache flushes (full D-windows evicted whole).

Padding: left-padded prompts (generate's default for decoder-only models) and any 2D
attention mask work: only the tokens the mask keeps are cached, so each sequence attends
exactly what SDPA over the padded cache would. Finished sequences (EOS) go on being
computed and appended, as transformers does with any cache.

MLA (DeepSeek-V2): transformers' DeepseekV2Attention hands update() the latent itself (the
normalized c_kv and the roped k_pe), so the cache holds one 576-element row per token and
layer; decode steps attend it in absorbed form (q' = q_nope W_UK ‖ q_pe, out = W_UV · the
latent output), with W_UK and W_UV taken from the module's kv_b_proj.

Not supported (each raises): sliding-window or chunked layers, beam search / cache reordering, a second multi-token input to a cache that holds tokens
(chunked prefill, assisted decoding, multi-turn continuation: use ``reset()``).
"""

from __future__ import annotations

import inspect
import threading
import weakref

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from . import CapacityError, ConfigError, KVCache, ShapeError, StateError, gqa, mla  # noqa: F401
from . import _errors

__all__ = ["WriteScopeCache", "writescope_attention", "ATTN_IMPLEMENTATION"]

ATTN_IMPLEMENTATION = "writescope"
_KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# The decode step whose K/V update() just appended, for the attention call that follows
# it in the same attention module's forward: (cache, layer index). Per thread.
_active = threading.local()


def _decoder_config(model):
    cfg = model.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class _Layer(CacheLayerMixin):
    """One layer's view for transformers' Cache API (lengths and mask sizes); the K/V
    themselves live in the parent's writescope.KVCache."""

    is_compileable = False
    is_sliding = False

    def __init__(self, parent):
        super().__init__()
        self._parent = weakref.proxy(parent)

    def lazy_initialization(self, key_states, value_states):
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise StateError("WriteScopeCache layers are updated through WriteScopeCache.update()")

    def get_seq_length(self) -> int:
        return self._parent._seq_len

    def get_mask_sizes(self, query_length, *args, **kwargs):
        if not isinstance(query_length, int):  # older call forms pass cache_position
            query_length = int(query_length.shape[0])
        return self._parent._seq_len + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self):
        pass

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("WriteScopeCache does not reorder sequences (beam search is not supported)")

    def crop(self, tokens_to_remove):
        raise NotImplementedError("WriteScopeCache cannot drop cached tokens (crop)")


class WriteScopeCache(Cache):
    """A transformers ``Cache`` whose K/V live in one writescope ``KVCache`` (docs/PYTHON.md).

    Args:
        model: the model this cache serves (its config gives layers, heads and head dim; its
            device picks the backend). A cache is bound to that model: used by another, it raises.
        policy: "roofline", "gpu_only", "cpu_only", "fixed_ratio" (with ``cpu_share``), or a
            CPU share r in [0, 1] (a fixed ratio).
        calibration: the roofline policy's costs (``cpu_cost_per_token_seconds``,
            ``gpu_cost_per_token_seconds``, ``cpu_fixed_seconds``, ``gpu_fixed_seconds``, ...).
        max_batch_size: the most sequences at once (D-window slots); default: the first
            prompt batch's size.
        max_cache_len: tokens per sequence, prompt and generated (default: the config's
            ``max_position_embeddings``); sizes both host regions unless their capacities
            are given (tokens per layer, all sequences together).
        hbm_capacity_tokens: the HBM-resident region, tokens per layer over all sequences (default
            0: none); a multiple of ``d_window_tokens`` (else ``ConfigError``). The policies fill it
            first; what does not fit goes to the host regions as without it.
        block_tokens, d_window_tokens: the block size and D (the eviction batch).
        backend: "host" (the library's emulated GPU side; CPU tensors) or "cuda"; default:
            "cuda" when the model is on a CUDA device.
        set_attention: set ``model``'s attention implementation to "writescope" when it is
            not (that function is plain SDPA wherever no WriteScopeCache decode step is on).
        Other keyword arguments go to ``writescope.KVCache`` (cpu_threads, ping_pong_bytes,
        pinned_initial_tokens, gpu_split_blocks, ...).
    """

    def __init__(self, model, policy="roofline", *, cpu_share=None, calibration=None, max_batch_size=None,
                 max_cache_len=None, block_tokens=64, d_window_tokens=256, cpu_capacity_tokens=None,
                 pinned_capacity_tokens=None, hbm_capacity_tokens=0, backend=None, set_attention=True,
                 **kv_options):
        cfg = _decoder_config(model)
        self._num_layers = int(cfg.num_hidden_layers)
        super().__init__(layers=[_Layer(self) for _ in range(self._num_layers)])
        types = getattr(cfg, "layer_types", None) or []
        other = sorted({t for t in types if t != "full_attention"})
        if other or (getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None)):
            raise ConfigError(f"WriteScopeCache: layer types {other or ['sliding_attention']} are not supported "
                              "(writescope attends every cached token); full attention only")
        hq = int(cfg.num_attention_heads)
        if getattr(cfg, "kv_lora_rank", None) is not None:  # MLA (DeepSeek-V2): the cache holds the latent rows
            rank, rope = int(cfg.kv_lora_rank), int(cfg.qk_rope_head_dim)
            self.layout = mla(hq, rank, rope)
            with _errors():
                torch.ops.writescope.validate_layout("mla", hq, 1, rank, rope)
        else:
            hkv = int(getattr(cfg, "num_key_value_heads", None) or hq)
            head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // hq)
            self.layout = gqa(hq, hkv, head_dim)
            with _errors():
                torch.ops.writescope.validate_layout("gqa", hq, hkv, head_dim, 0)
        device = next(model.parameters()).device
        self.device = device
        self.backend = backend or ("cuda" if device.type == "cuda" else "host")
        self.policy = policy
        self._policy_args = dict(cpu_share=cpu_share, calibration=calibration)
        self._spec = dict(block_tokens=block_tokens, d_window_tokens=d_window_tokens,
                          cpu_capacity_tokens=cpu_capacity_tokens, pinned_capacity_tokens=pinned_capacity_tokens,
                          hbm_capacity_tokens=hbm_capacity_tokens, max_cache_len=int(max_cache_len or getattr(cfg, "max_position_embeddings", 0) or 4096))
        hbm, d = int(hbm_capacity_tokens), int(d_window_tokens)
        if hbm < 0 or (d > 0 and hbm % d):
            # the binding's rule (KVCache refuses the same), checked here too so that a cache without
            # max_batch_size refuses it at construction, not at the first prompt
            raise ConfigError(f"WriteScopeCache: hbm_capacity_tokens = {hbm} must be >= 0 and a whole number of "
                              f"eviction batches (a multiple of d_window_tokens = {d}); 0: no HBM-resident region")
        self._kv_options = kv_options
        self.kv = None  # the writescope.KVCache, created with the first prompt batch unless max_batch_size is given
        self._seqs: list[int] = []
        self._seq_len = 0  # positions per row, padding included (what the 2D attention mask spans)
        self._model_ref = weakref.ref(model)
        self._model_name = type(model).__name__
        self._attention_modules = {id(m) for m in model.modules() if hasattr(m, "layer_idx")}
        self._forward = None  # the attention mask of the model forward in progress, or None when none is
        self._forward_host = None  # a prompt forward's device mask: (pinned host copy, its copy's CUDA event)
        self._in_forward = False
        self._prefilling = False
        self._absorbed = {}  # MLA: id(attention module) -> (weight, version, W_UK, W_UV^T)
        self._valid = None
        self._firsts = None  # the prefill's first token of each row in the flattened [batch * tokens] K/V
        self._gather = None  # rows that are no suffix of the prompt: the kept positions of the flattened K/V
        self._writes_pending = False  # a prefill's deferred host writes are still pending (cuda)
        self._check_mask_values = True  # the next decode step reads its mask's values (_check_decode_mask)
        self._decode_steps = 0  # decode steps completed (all layers) since creation
        self.last_flush = None
        if set_attention and getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self._install_hooks(model)
        if max_batch_size is not None:
            self._create(int(max_batch_size))

    # ---- binding to the model ------------------------------------------------------------
    def _install_hooks(self, model):
        params = list(inspect.signature(model.forward).parameters)
        mask_pos = params.index("attention_mask") if "attention_mask" in params else None
        me = weakref.ref(self)

        def pre(module, args, kwargs):
            cache = me()
            if cache is None:
                return
            pkv = kwargs.get("past_key_values", kwargs.get("cache"))
            if pkv is not cache:
                return
            mask = kwargs.get("attention_mask")
            if mask is None and mask_pos is not None and len(args) > mask_pos:
                mask = args[mask_pos]
            cache._in_forward = True
            cache._forward = mask
            cache._forward_host = None
            if (isinstance(mask, torch.Tensor) and mask.is_cuda and mask.dim() == 2
                    and not (cache._seqs and mask.shape[-1] == cache._seq_len + 1)):
                # a prompt forward: its admission (layer 0) needs the mask on the host; copied now, ahead
                # of the forward's own work, the read there waits for this copy only, not for the
                # embedding and the layer's projections queued before it
                host = torch.empty(mask.shape, dtype=mask.dtype, pin_memory=True)
                host.copy_(mask, non_blocking=True)
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(mask.device))
                cache._forward_host = (host, done)
            _active.forward = cache  # writescope_mask: this thread runs a forward over this cache

        def post(module, args, kwargs, output):
            cache = me()
            if getattr(_active, "forward", None) is cache:
                _active.forward = None
            if cache is not None:
                cache._in_forward = False
                cache._forward = None
                cache._forward_host = None
                if cache._writes_pending:
                    # the end of a prefill forward: the last layer's deferred host writes land
                    # here, while the device still runs that layer's attention and MLP
                    cache._writes_pending = False
                    cache.kv.complete_writes()

        handles = [model.register_forward_pre_hook(pre, with_kwargs=True),
                   model.register_forward_hook(post, with_kwargs=True, always_call=True)]
        weakref.finalize(self, lambda hs=handles: [h.remove() for h in hs])

    def _create(self, batch: int):
        s = self._spec
        d = int(s["d_window_tokens"])
        per_seq = _round_up(s["max_cache_len"], d) + d
        cap = batch * per_seq
        opts = dict(self._kv_options)
        if self.backend == "cuda":
            opts.setdefault("pinned_initial_tokens", 0)  # page-locked as it fills, between steps
        self.kv = KVCache(self.layout, self._num_layers, max_sequences=batch,
                          cpu_capacity_tokens=cap if s["cpu_capacity_tokens"] is None else s["cpu_capacity_tokens"],
                          pinned_capacity_tokens=cap if s["pinned_capacity_tokens"] is None else s["pinned_capacity_tokens"],
                          hbm_capacity_tokens=s["hbm_capacity_tokens"],
                          block_tokens=s["block_tokens"], d_window_tokens=d, policy=self.policy,
                          backend=self.backend, **self._policy_args, **opts)

    def _check_bound(self, what: str):
        if not self._in_forward:
            raise StateError(f"WriteScopeCache.{what}: called outside a forward of the model this cache was built for "
                             f"({self._model_name}); a WriteScopeCache serves one model (make one per model)")

    # ---- transformers' Cache API ---------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seq_len

    def get_mask_sizes(self, query_length, layer_idx: int = 0):
        if not isinstance(query_length, int):
            query_length = int(query_length.shape[0])
        return self._seq_len + query_length, 0

    def get_max_length(self, layer_idx=None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return bool(self._seqs)

    @property
    def batch_size(self) -> int:
        return len(self._seqs) if self._seqs else -1

    def reset(self):
        """Ends every sequence: the cache is empty again (its regions stay allocated)."""
        if self.kv is not None:
            for s in self._seqs:
                self.kv.end_sequence(s)
        self._seqs = []
        self._seq_len = 0

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("WriteScopeCache does not reorder sequences (beam search is not supported)")

    def crop(self, tokens_to_remove):
        raise NotImplementedError("WriteScopeCache cannot drop cached tokens (crop: assisted decoding is not supported)")

    def batch_repeat_interleave(self, repeats):
        if self._seqs:
            raise NotImplementedError("WriteScopeCache cannot repeat cached sequences")

    def batch_select_indices(self, indices):
        if self._seqs:
            raise NotImplementedError("WriteScopeCache cannot select cached sequences")

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Appends layer ``layer_idx``'s new K/V ([batch, kv_heads, tokens, head_dim]) to the writescope cache."""
        self._check_bound("update")
        b, h, t, dh = key_states.shape
        lay = self.layout
        if lay.kind == "gqa":
            want = ((b, lay.num_kv_heads, t, lay.head_dim),) * 2
            what = f"{lay.num_kv_heads} KV heads of {lay.head_dim}"
        else:  # DeepSeek-V2's attention caches the normalized latent and the roped key part
            want = ((b, 1, t, lay.kv_lora_rank), (b, 1, t, lay.rope_dim))
            what = f"MLA latent rows of {lay.kv_lora_rank} + {lay.rope_dim}"
        if (tuple(key_states.shape), tuple(value_states.shape)) != want:
            raise ShapeError(f"WriteScopeCache.update: K/V of shape {tuple(key_states.shape)} / "
                             f"{tuple(value_states.shape)} for a cache of {what}")
        if key_states.dtype not in _KV_DTYPES:
            raise ShapeError(f"WriteScopeCache.update: K/V dtype {key_states.dtype} is not supported; the cache stores "
                             "bfloat16 and takes bfloat16, float16 or float32 (converted to bfloat16)")
        if not 0 <= layer_idx < self._num_layers:
            raise ShapeError(f"WriteScopeCache.update: layer {layer_idx} outside [0, {self._num_layers})")
        if layer_idx == 0 and not self._seqs:
            self._admit(b, t)
        if len(self._seqs) != b:
            raise ShapeError(f"WriteScopeCache.update: a batch of {b} rows for a cache holding {len(self._seqs)} "
                             "sequences")
        if self._prefilling:
            self._append_prefill(layer_idx, key_states, value_states)
            if layer_idx == self._num_layers - 1:
                self._prefilling = False
                self._seq_len = t
            return key_states, value_states
        if t != 1:
            raise NotImplementedError(
                f"WriteScopeCache.update: {t} new tokens per sequence for a cache that holds tokens; writescope "
                "attends one query token per sequence after the prompt (no chunked prefill, assisted decoding or "
                "continuation: reset() the cache for a new prompt)")
        if layer_idx == 0:
            self._check_decode_mask()
            model = self._model_ref()
            impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
            if impl != ATTN_IMPLEMENTATION:
                raise ConfigError(f"WriteScopeCache: the model's attention implementation is {impl!r}; decoding "
                                  f"from a WriteScopeCache needs {ATTN_IMPLEMENTATION!r} "
                                  f"(model.set_attn_implementation({ATTN_IMPLEMENTATION!r}))")
        if lay.kind == "gqa":
            self.kv.append(layer_idx, self._seqs, key_states[:, :, 0, :].to(torch.bfloat16),
                           value_states[:, :, 0, :].to(torch.bfloat16))
        else:
            self.kv.append(layer_idx, self._seqs, self._latent_rows(key_states, value_states)[:, 0])
        _active.state = (self, layer_idx)
        return key_states, value_states

    # ---- prefill -------------------------------------------------------------------------
    def _valid_rows(self, b: int, t: int):
        """Per row, the positions of the prompt the 2D attention mask keeps (None: all)."""
        mask = self._forward
        if mask is None:
            return None
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            raise ShapeError("WriteScopeCache: the model was given an attention mask of shape "
                             f"{tuple(getattr(mask, 'shape', ()))}; writescope takes a 2D padding mask [batch, tokens]")
        if tuple(mask.shape) != (b, t):
            raise ShapeError(f"WriteScopeCache: attention mask of shape {tuple(mask.shape)} for a prompt batch of "
                             f"{b} x {t} tokens")
        if self._forward_host is not None:  # copied by the forward's pre-hook
            host, done = self._forward_host
            done.synchronize()
            m = host.to(dtype=torch.bool)
        else:
            m = mask.to(device="cpu", dtype=torch.bool)
        return None if bool(m.all()) else m

    def _admit(self, b: int, t: int):
        if self.kv is None:
            self._create(b)
        valid = self._valid_rows(b, t)
        counts = [t] * b if valid is None else [int(n) for n in valid.sum(dim=1).tolist()]
        self._valid = valid
        self._firsts, self._gather = self._prefill_rows(valid, counts, b, t)
        self.kv.announce_admission(sum(counts))
        seqs = []
        try:
            for n in counts:
                seqs.append(self.kv.begin_sequence(n))
        except BaseException:
            for s in seqs:
                self.kv.end_sequence(s)
            self.kv.announce_admission(0)
            raise
        self._seqs = seqs
        self._prefilling = True
        self._check_mask_values = True

    def _prefill_rows(self, valid, counts, b: int, t: int):
        """Where each row's prompt lies in the layer's K/V flattened to [b * t, ...]: (first tokens,
        None) when every row's kept positions are one range (no mask, left padding: a suffix);
        otherwise the kept positions of all rows, in order, as an index (the K/V is gathered, and
        row i's prompt starts after the kept tokens of the rows before it)."""
        if valid is None:
            return [i * t for i in range(b)], None
        firsts = []
        for i, n in enumerate(counts):
            start = int(valid[i].to(torch.int8).argmax()) if n else t
            if not bool(valid[i, start:start + n].all()):
                break
            firsts.append(i * t + start)
        else:
            return firsts, None
        offsets = [0]
        for n in counts[:-1]:
            offsets.append(offsets[-1] + n)
        gather = valid.reshape(-1).nonzero().flatten().to(self.device)
        return offsets, gather

    def _append_prefill(self, layer: int, key_states, value_states):
        # token-major [batch * tokens, kv_heads, row] bf16, one copy for the batch, one write per layer
        b, h, t, dh = key_states.shape
        if self.layout.kind == "gqa":
            k = key_states.to(torch.bfloat16).transpose(1, 2).contiguous().view(b * t, h, dh)
            v = value_states.to(torch.bfloat16).transpose(1, 2).contiguous().view(b * t, h, dh)
        else:
            k, v = self._latent_rows(key_states, value_states).flatten(0, 1), None
        if self._gather is not None:
            k = k.index_select(0, self._gather)
            v = v.index_select(0, self._gather) if v is not None else None
        self.kv.append_prefill_batch(layer, self._seqs, self._firsts, k, v)
        self._writes_pending = self.kv.backend == "cuda"

    @staticmethod
    def _latent_rows(c_kv, k_pe):
        """MLA: [batch, 1, tokens, rank] and [batch, 1, tokens, rope] -> rows c_kv ‖ k_pe, [batch, tokens, 1, rank + rope] bf16."""
        return torch.cat([c_kv, k_pe], dim=-1).to(torch.bfloat16).transpose(1, 2).contiguous()

    def _check_decode_mask(self):
        """A decode step's 2D mask: its shape at every step (tensor metadata, no device work); that it keeps
        every row's new token on every step for a CPU mask, and for a mask on a device on the first decode
        step after each prompt only. Reading a device mask's values waits for the device (a
        synchronization), which at every step costs a measurable share of it; generate() extends the mask
        with a column of ones at each step, so for generate() the first step's check is the check of all.
        A hand-written loop with a device mask that hides the new token on a later step is not refused:
        that token is cached and attended anyway."""
        mask = self._forward
        if mask is None:
            return
        if mask.dim() != 2 or mask.shape[-1] != self._seq_len + 1:
            raise ShapeError(f"WriteScopeCache: a decode step's attention mask has shape {tuple(mask.shape)}, "
                             f"expected [batch, {self._seq_len + 1}] (the cached positions and the new token)")
        if mask.device.type != "cpu" and not self._check_mask_values:
            return
        if not bool(mask[:, -1].to(torch.bool).all()):
            raise ShapeError("WriteScopeCache: a decode step's attention mask masks the new token of some row; "
                             "writescope caches every decode token (as generate() does)")
        self._check_mask_values = False

    # ---- decode attention ----------------------------------------------------------------
    def _decode(self, module, query, scaling):
        if id(module) not in self._attention_modules:
            raise StateError(f"WriteScopeCache: an attention module of another model; this cache serves "
                             f"{self._model_name}")
        layer = module.layer_idx
        b, hq, t, dh = query.shape
        if scaling is None:
            scaling = dh ** -0.5
        if self.layout.kind == "mla":
            # Absorbed MLA: the score of head h is q_nope·(W_UK_h c) + q_pe·k_pe = (q_nope W_UK_h)·c + q_pe·k_pe,
            # and its output W_UV_h (sum_t p_t c_t): the latent rows attended with q' = q_nope W_UK ‖ q_pe, all in
            # one op (KVCache.mla_attention).
            w_uk, w_uv_t = self._absorbed_weights(module)
            out = self.kv.mla_attention(layer, self._seqs, query, w_uk, w_uv_t, float(scaling))
        else:
            out, _ = self.kv.attention(layer, self._seqs, query[:, :, 0, :].to(torch.float32), float(scaling))
            out = out.to(query.dtype).unsqueeze(1)
        if layer == self._num_layers - 1:
            self.last_flush = self.kv.flush()
            self._seq_len += 1
            self._decode_steps += 1
        return out

    def _absorbed_weights(self, module):
        """W_UK [heads, nope, rank] and W_UV^T [heads, rank, v] of an MLA module's kv_b_proj, fp32 (kept per module
        while the weight is unchanged)."""
        w = getattr(module, "kv_b_proj").weight
        cached = self._absorbed.get(id(module))
        if cached is None or cached[0] is not w or cached[1] != w._version:
            per_head = w.detach().to(torch.float32).view(module.num_heads, module.qk_nope_head_dim + module.v_head_dim,
                                                         self.layout.kv_lora_rank)
            cached = (w, w._version, per_head[:, :module.qk_nope_head_dim].contiguous(),
                      per_head[:, module.qk_nope_head_dim:].transpose(1, 2).contiguous())
            self._absorbed[id(module)] = cached
        return cached[2], cached[3]

    def learned_calibration(self) -> dict:
        """The roofline's costs as this cache has learned them in its decode steps (seconds per KV token of
        one layer: ``cpu_cost_per_token_seconds`` A, ``gpu_cost_per_token_seconds`` B,
        ``launch_cost_per_token_seconds`` K; the fixed costs as given), to pass as ``calibration=`` to the
        next cache for the same model on this machine: a cache places its prompts before it has measured
        anything, so a new one otherwise places them at ``DEFAULT_ROOFLINE``'s share. Raises ConfigError
        for a policy other than "roofline" and StateError before this cache's first decode step."""
        if self.policy != "roofline":
            raise ConfigError(f"WriteScopeCache.learned_calibration: the policy is {self.policy!r}; only 'roofline' "
                              f"learns costs")
        if self.kv is None or self._decode_steps == 0:
            raise StateError("WriteScopeCache.learned_calibration: no decode step has run on this cache yet "
                             "(the costs are still the starting ones)")
        state = self.kv.policy_state()
        out = {k: float(state[k]) for k in ("cpu_cost_per_token_seconds", "gpu_cost_per_token_seconds",
                                            "launch_cost_per_token_seconds") if k in state}
        given = self._policy_args.get("calibration") or {}
        for k in ("cpu_fixed_seconds", "gpu_fixed_seconds"):
            if k in given:
                out[k] = float(given[k])
        return out

    def split(self) -> dict:
        """Where the cached tokens are now (see KVCache.split), plus the policy's target share."""
        if self.kv is None:
            return {"cpu_tokens": 0, "pinned_tokens": 0, "hbm_tokens": 0, "cpu_share": 0.0, "live_sequences": 0}
        self.kv.complete_writes()  # nothing is read from the blocks, but what split() counts has landed
        s = self.kv.split()
        s["target_share"] = self.kv.policy_state().get("target_share", 0.0)
        return s

    def __repr__(self):
        return f"WriteScopeCache({self.kv!r}, {len(self._seqs)} sequences, {self._seq_len} positions)"


def writescope_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The "writescope" attention: hybrid decode attention for a WriteScopeCache decode step
    (after its update()), the model's SDPA otherwise (prompts, other caches, no cache)."""
    state = getattr(_active, "state", None)
    _active.state = None
    if state is not None:
        cache, layer = state
        if layer != getattr(module, "layer_idx", None):
            raise StateError(f"writescope attention: layer {getattr(module, 'layer_idx', None)} follows the update "
                             f"of layer {layer}")
        if query.shape[2] == 1:
            return cache._decode(module, query, scaling), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def writescope_mask(*args, **kwargs):
    """The mask of the "writescope" attention: none for a one-token query of a forward over a
    WriteScopeCache (its decode attention reads the cache's own block tables and ignores a mask, and
    building one reads the padding mask on the device: a synchronization per step;
    WriteScopeCache._check_decode_mask checks the 2D mask itself), transformers' SDPA mask otherwise
    (prompts, other caches, no cache)."""
    cache = getattr(_active, "forward", None)
    if cache is not None and cache._seqs and kwargs.get("q_length") == 1:  # sequences held: a decode step
        return None
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(ATTN_IMPLEMENTATION, writescope_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, writescope_mask)
