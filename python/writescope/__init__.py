# SPDX-License-Identifier: Apache-2.0
"""writescope: decode attention over a KV cache split between host memory and the GPU.

``KVCache`` is one ``inplace_kv_cache`` of the C++ library with its ``hybrid_attention``
(docs/PYTHON.md); ``writescope.hf`` puts it under HF transformers' ``generate()``.

Tensors: K/V rows are bfloat16, token-major ``[tokens, kv_heads, row]``; queries and
outputs float32. On ``backend="host"`` tensors are CPU tensors (the library's host
backend emulates the GPU side); on ``backend="cuda"`` they are CUDA tensors and the
work is ordered on torch's current stream.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Sequence

import torch

from . import _C  # noqa: F401  (loads the library: torch.ops.writescope, torch.classes.writescope)

__all__ = [
    "Error", "ConfigError", "ShapeError", "StateError", "CapacityError", "ResourceError",
    "PinnedMemoryError", "CudaError", "CheckpointError",
    "KVCache", "Layout", "gqa", "mla", "cuda_built", "build_info", "SUPPORTED_GQA_HEAD_DIMS",
]

SUPPORTED_GQA_HEAD_DIMS = (64, 128, 256)
MLA_KV_LORA_RANK = 512
MLA_ROPE_DIM = 64


# --- errors -------------------------------------------------------------------------------
class Error(Exception):
    """Base of every exception writescope raises (the library's ``writescope::error``)."""


class ConfigError(Error, ValueError):
    """A configuration that can never work (unsupported head dim, bad partition spec, policy value)."""


class ShapeError(Error, ValueError):
    """A tensor or argument that does not match what the call requires (shape, dtype, device, layer)."""


class StateError(Error, RuntimeError):
    """A call that is valid in general but not in the cache's current state."""


class CapacityError(Error, RuntimeError):
    """A region or pool would exceed the capacity fixed at creation; the cache is unchanged."""


class ResourceError(Error, RuntimeError):
    """Memory refused by the system (host, pinned or device), at creation or region growth."""


class PinnedMemoryError(ResourceError):
    """Page-locking was refused."""


class CudaError(Error, RuntimeError):
    """A CUDA runtime call failed (or no device is usable)."""


class CheckpointError(Error, RuntimeError):
    """A calibration or checkpoint file is missing or malformed."""


_ERRORS = {c.__name__: c for c in (Error, ConfigError, ShapeError, StateError, CapacityError, ResourceError,
                                   PinnedMemoryError, CudaError, CheckpointError)}
_TAG = re.compile(r"\[writescope\.(\w+)\] (.*)", re.DOTALL)


def _translate(e: BaseException) -> BaseException | None:
    m = _TAG.search(str(e))
    if m is None:
        return None
    msg = m.group(2).split("\nException raised from", 1)[0].rstrip()
    return _ERRORS.get(m.group(1), Error)(msg)


@contextlib.contextmanager
def _errors():
    """Turns the extension's tagged c10 errors into writescope exceptions."""
    try:
        yield
    except (RuntimeError, ValueError) as e:
        if isinstance(e, Error):
            raise
        t = _translate(e)
        if t is None:
            raise
        raise t from None


def cuda_built() -> bool:
    """Whether this build of the extension has the CUDA backend."""
    return bool(torch.ops.writescope.cuda_built())


def build_info() -> str:
    """How the extension was built (CPU ISA; CUDA backend built, or why not)."""
    return str(torch.ops.writescope.build_info())


# --- layouts ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """What one token's KV is. ``gqa``: K and V rows of ``head_dim`` per KV head;
    ``mla``: one latent row (``kv_lora_rank`` + ``rope_dim``) per token, shared by all heads."""

    kind: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0

    @property
    def planes(self) -> int:
        return 2 if self.kind == "gqa" else 1

    @property
    def row(self) -> int:
        return self.head_dim if self.kind == "gqa" else self.kv_lora_rank + self.rope_dim

    @property
    def q_dim(self) -> int:
        return self.row

    @property
    def v_dim(self) -> int:
        return self.head_dim if self.kind == "gqa" else self.kv_lora_rank

    @property
    def token_bytes(self) -> int:
        """bf16 bytes of one token's KV in one layer."""
        return self.planes * self.num_kv_heads * self.row * 2


def gqa(num_q_heads: int, num_kv_heads: int, head_dim: int) -> Layout:
    return Layout("gqa", int(num_q_heads), int(num_kv_heads), head_dim=int(head_dim))


def mla(num_q_heads: int, kv_lora_rank: int = MLA_KV_LORA_RANK, rope_dim: int = MLA_ROPE_DIM) -> Layout:
    return Layout("mla", int(num_q_heads), 1, kv_lora_rank=int(kv_lora_rank), rope_dim=int(rope_dim))


# --- the cache ----------------------------------------------------------------------------
_POLICIES = ("roofline", "fixed_ratio", "gpu_only", "cpu_only")
_INT_OPTIONS = ("ping_pong_buffers", "first_chunk_bytes", "gpu_split_blocks", "cpu_task_blocks",
                "pinned_initial_tokens", "pinned_growth_tokens", "task_workspace_reserve_bytes",
                "cost_window_samples", "deferred_host_write_bytes", "staging_bytes", "cpu_prefault_tokens",
                "track_gpu_cost", "track_launch_cost", "track_hbm_cost", "resident_kernel", "all_gpu_steps")
_ROOFLINE_KEYS = ("cpu_cost_per_token_seconds", "gpu_cost_per_token_seconds", "cpu_fixed_seconds",
                  "gpu_fixed_seconds", "placement_headroom", "launch_cost_per_token_seconds",
                  "hbm_cost_per_token_seconds", "placement_headroom_z")
# An uncalibrated starting point for the roofline policy (A, B per KV token of 2 KiB); A is
# re-estimated online from measured steps. Calibrate (bench/calibrate) for real runs.
DEFAULT_ROOFLINE = {"cpu_cost_per_token_seconds": 2.6e-8, "gpu_cost_per_token_seconds": 3.8e-8}


def _policy_args(policy, cpu_share, calibration):
    """(policy name, float options) from policy="roofline" | "gpu_only" | "cpu_only" | "fixed_ratio" | a share r."""
    reals = {}
    if isinstance(policy, (int, float)) and not isinstance(policy, bool):
        cpu_share, policy = float(policy), "fixed_ratio"
    if policy not in _POLICIES:
        raise ConfigError(f"policy {policy!r} is not supported; supported: {', '.join(_POLICIES)} or a CPU share in [0, 1]")
    if policy == "fixed_ratio":
        if cpu_share is None:
            raise ConfigError("policy 'fixed_ratio' needs cpu_share (the CPU's share r in [0, 1])")
        reals["cpu_share"] = float(cpu_share)
    if policy == "roofline":
        cal = dict(DEFAULT_ROOFLINE)
        for k, v in (calibration or {}).items():
            if k not in _ROOFLINE_KEYS:
                raise ConfigError(f"calibration key {k!r} is not one of {', '.join(_ROOFLINE_KEYS)}")
            cal[k] = float(v)
        reals.update(cal)
    elif calibration:
        raise ConfigError(f"calibration is for policy 'roofline', not {policy!r}")
    return policy, reals


class KVCache:
    """One writescope cache (all layers) with its hybrid attention.

    ``capacity`` values are tokens per layer over all sequences together. The unpinned
    compute region is reserved at creation and becomes resident as it is written; the
    pinned load region is page-locked (cuda backend) as ``pinned_initial_tokens`` says
    (default: all of it at creation) and grows between steps. ``hbm_capacity_tokens``
    (default 0: none) adds the HBM-resident region (``partition_spec::hbm_capacity_tokens``):
    device memory allocated at creation, a whole number of eviction batches (a multiple of
    ``d_window_tokens``; anything else raises ``ConfigError``), filled first by the policies
    and attended in place by the GPU side (host backend: emulated device memory).
    """

    def __init__(self, layout: Layout, num_layers: int, *, max_sequences: int,
                 cpu_capacity_tokens: int, pinned_capacity_tokens: int, hbm_capacity_tokens: int = 0,
                 block_tokens: int = 64, d_window_tokens: int = 256, ping_pong_bytes: int = 64 << 20,
                 policy="roofline", cpu_share: float | None = None, calibration: dict | None = None,
                 backend: str = "host", cpu_threads: int = 0, poison: bool = False, **options):
        for k in options:
            if k not in _INT_OPTIONS:
                raise ConfigError(f"KVCache: unknown option {k!r}")
        name, reals = _policy_args(policy, cpu_share, calibration)
        ints = {
            "num_q_heads": layout.num_q_heads, "num_kv_heads": layout.num_kv_heads,
            "num_layers": num_layers, "block_tokens": block_tokens, "d_window_tokens": d_window_tokens,
            "max_sequences": max_sequences, "cpu_capacity_tokens": cpu_capacity_tokens,
            "pinned_capacity_tokens": pinned_capacity_tokens, "hbm_capacity_tokens": hbm_capacity_tokens,
            "ping_pong_bytes": ping_pong_bytes,
            "cpu_threads": cpu_threads, "poison": int(bool(poison)),
        }
        if layout.kind == "gqa":
            ints["head_dim"] = layout.head_dim
        else:
            ints.update(kv_lora_rank=layout.kv_lora_rank, rope_dim=layout.rope_dim)
        ints.update({k: int(v) for k, v in options.items()})
        self.layout = layout
        self.num_layers = int(num_layers)
        self.policy = name
        self.backend = backend
        with _errors():
            self._c = torch.classes.writescope.Cache(layout.kind, name, backend, {k: int(v) for k, v in ints.items()},
                                                     reals)

    # sequences
    def begin_sequence(self, prompt_tokens: int) -> int:
        """Admits a sequence of ``prompt_tokens`` prompt tokens; returns its id. CapacityError: nothing changed."""
        with _errors():
            return int(self._c.begin_sequence(int(prompt_tokens)))

    def end_sequence(self, seq: int) -> None:
        with _errors():
            self._c.end_sequence(int(seq))

    def announce_admission(self, prompt_tokens: int) -> None:
        """The next begin_sequence() calls admit this many prompt tokens in all (routing hint)."""
        with _errors():
            self._c.announce_admission(int(prompt_tokens))

    # append
    def append_prefill(self, layer: int, seq: int, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """Writes the whole prompt of ``seq`` for ``layer``: k, v ``[prompt_tokens, kv_heads, row]`` bf16."""
        with _errors():
            torch.ops.writescope.append_prefill(self._c, int(layer), int(seq), k, v)

    def append_prefill_batch(self, layer: int, seqs: Sequence[int], first_tokens: Sequence[int], k: torch.Tensor,
                             v: torch.Tensor | None = None) -> None:
        """Writes the prompts of several sequences for ``layer`` in one backend write: k, v
        ``[tokens, kv_heads, row]`` bf16 hold them all, ``seqs[i]``'s prompt its tokens
        ``[first_tokens[i], first_tokens[i] + prompt tokens)``. The same placement and bytes as one
        append_prefill per sequence; nothing is written unless every sequence passes."""
        with _errors():
            torch.ops.writescope.append_prefill_batch(self._c, int(layer), [int(s) for s in seqs],
                                                      [int(t) for t in first_tokens], k, v)

    def complete_writes(self) -> None:
        """Finishes the deferred prefill writes into the unpinned region (cuda backend,
        ``deferred_host_write_bytes``); a no-op when none is pending and on the host backend."""
        with _errors():
            self._c.complete_host_writes()

    def append(self, layer: int, seqs: Sequence[int], k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """One decode token per sequence into its D-window: k, v ``[len(seqs), kv_heads, row]`` bf16."""
        with _errors():
            torch.ops.writescope.append(self._c, int(layer), [int(s) for s in seqs], k, v)

    # attention
    def attention(self, layer: int, seqs: Sequence[int], q: torch.Tensor, scale: float):
        """Decode attention over every cached token of each sequence.

        q ``[len(seqs), num_q_heads, q_dim]`` float32 -> (out ``[len(seqs), num_q_heads, v_dim]``,
        lse ``[len(seqs), num_q_heads]``), float32, natural-log LSE."""
        with _errors():
            return torch.ops.writescope.decode_attention(self._c, int(layer), [int(s) for s in seqs], q, float(scale))

    def mla_attention(self, layer: int, seqs: Sequence[int], query: torch.Tensor, w_uk: torch.Tensor,
                      w_uv_t: torch.Tensor, scale: float) -> torch.Tensor:
        """Absorbed MLA decode attention from a model's query, in one op: q' = q_nope W_UK ‖ q_pe per head,
        :meth:`attention` over the latent rows, the output times W_UV per head.

        query ``[len(seqs), heads, 1, nope + rope]`` (any float dtype), w_uk ``[heads, nope, kv_lora_rank]``
        and w_uv_t ``[heads, kv_lora_rank, v_head_dim]`` float32, all on the cache's device ->
        ``[len(seqs), 1, heads, v_head_dim]`` in query's dtype."""
        with _errors():
            return torch.ops.writescope.mla_decode_attention(self._c, int(layer), [int(s) for s in seqs], query, w_uk,
                                                             w_uv_t, float(scale))

    def flush(self) -> dict:
        """After the last layer of a decode step: evicts every full D-window to the side the policy picks."""
        with _errors():
            ev, cpu, gpu = torch.ops.writescope.flush(self._c)
        return {"evicted_sequences": ev, "cpu_batches": cpu, "gpu_batches": gpu}

    # introspection
    def usage(self) -> dict:
        with _errors():
            return dict(self._c.usage())

    def sequence(self, seq: int) -> dict:
        with _errors():
            return dict(self._c.sequence(int(seq)))

    def last_step(self) -> dict:
        """The step_report of the last attention() call (seconds and token counts)."""
        with _errors():
            return dict(self._c.last_step())

    def policy_state(self) -> dict:
        with _errors():
            return dict(self._c.policy_state())

    def read_token(self, layer: int, seq: int, position: int) -> torch.Tensor:
        """The cached K/V of one token, ``[planes, kv_heads, row]`` bf16 on the host (tests, debugging)."""
        with _errors():
            return self._c.read_token(int(layer), int(seq), int(position))

    def split(self) -> dict:
        """Where the placed tokens of the live sequences are, per layer: ``cpu_tokens`` (the unpinned
        compute region, attended by the CPU side), ``pinned_tokens`` (the pinned load region, streamed),
        ``hbm_tokens`` (the HBM-resident region, attended in place; 0 without one); ``cpu_share`` is the
        CPU's share of the host-placed tokens, cpu / (cpu + pinned), the share the policies set
        (the D-window's tokens are in none of them)."""
        u = self.usage()
        bt = u["block_tokens"]
        cpu, pinned, hbm = u["cpu_used_blocks"] * bt, u["pinned_used_blocks"] * bt, u["hbm_used_blocks"] * bt
        host = cpu + pinned
        return {"cpu_tokens": cpu, "pinned_tokens": pinned, "hbm_tokens": hbm,
                "cpu_share": cpu / host if host else 0.0, "live_sequences": u["live_sequences"]}

    def __repr__(self):
        with _errors():
            return f"writescope.KVCache({self._c.describe()}, policy {self.policy}, {self.num_layers} layers)"
