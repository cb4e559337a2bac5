"""A deterministic tiny transformer, tensor-parallel over processes, reading a paged KV cache.

Why it exists: the messenger needs a real producer and consumer of KV caches on a CPU machine,
and disaggregated serving needs an oracle. Weights come from a seed (no downloads), tokens are
bytes (256 values + EOS), blocks are RMSNorm → attention → RMSNorm → SwiGLU MLP.

Two attention variants:
  * ``gqa``: query heads grouped over KV heads; each TP rank holds its query heads and the KV
    heads they read (``transfer.routes.ShardSpec.heads_of``: split, or replicated in groups
    when tp > KV heads). Cache per layer: ``[pages, 2, kv_heads_local, page_size, head_dim]``
    (FlashInfer's HND paged layout, K then V).
  * ``mla``: DeepSeek-style latent cache: one compressed vector (``kv_lora_rank``) plus a shared
    RoPE key, replicated on every rank (``[pages, 1, 1, page_size, rank + rope]``) and
    up-projected per local head inside attention.

Every rank generates the full weights from the seed and keeps only its slices, so any TP degree
computes the same function; column-parallel projections, row-parallel outputs and an all-reduce
(gloo) per block. Compute is float64 by default, the cache float32: different TP degrees, batch
shapes and chunkings sum in different orders, and float64 keeps that noise (~1e-16) so far below
the gap between the two best logits that a greedy argmax never flips, so token-exact tests are
exact rather than lucky. The float32 cache is what travels over the messenger.

A small MTP-style draft head (DeepSeek-V3 style: norm(hidden) ⊕ norm(embed(next token)) → one
projection → the shared LM head) turns the hidden state the prefill ships (position N-2) and
the last prompt token into a draft of the first generated token. The decoder's first step runs
[last prompt token, draft] and verifies it: when right, the token after it comes in the same
step; either way the text is the greedy one, so the hidden state changes speed, never output.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from transfer.routes import ShardSpec

from .tokens import EOS

VOCAB = EOS + 1
_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class TinyConfig:
    """Shape of the reference model; every field has a default so `TinyConfig()` works."""

    attention: str = "gqa"  # "gqa" or "mla"
    num_layers: int = 2
    hidden: int = 64
    num_q_heads: int = 4
    num_kv_heads: int = 2  # gqa only
    head_dim: int = 16  # gqa only
    kv_lora_rank: int = 32  # mla only
    qk_rope_dim: int = 8  # mla only
    qk_nope_dim: int = 16  # mla only
    v_head_dim: int = 16  # mla only
    intermediate: int = 128
    rope_theta: float = 10000.0
    seed: int = 0
    dtype: str = "float64"  # compute dtype
    kv_dtype: str = "float32"  # what the cache pages (and the transfers) hold

    def __post_init__(self) -> None:
        if self.attention not in ("gqa", "mla"):
            raise ValueError(f"model.attention must be 'gqa' or 'mla', got {self.attention!r}")
        for key in ("dtype", "kv_dtype"):
            if getattr(self, key) not in _DTYPES:
                raise ValueError(
                    f"model.{key} must be one of {sorted(_DTYPES)}, got {getattr(self, key)!r}"
                )
        if self.attention == "gqa" and self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads={self.num_q_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        return _DTYPES[self.kv_dtype]

    @property
    def cache_heads(self) -> int:
        """KV "heads" of the cache: the latent is one head."""
        return 1 if self.attention == "mla" else self.num_kv_heads

    @property
    def kv_parts(self) -> int:
        return 1 if self.attention == "mla" else 2

    @property
    def cache_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_dim if self.attention == "mla" else self.head_dim

    def shard_spec(self, tp: int) -> ShardSpec:
        """The KV-cache sharding for `tp`, as the messenger's route math sees it."""
        return ShardSpec(num_kv_heads=self.cache_heads, tp=tp)

    def check_tp(self, tp: int) -> None:
        if tp < 1 or self.num_q_heads % tp or self.intermediate % tp:
            raise ValueError(
                f"tp={tp} must divide num_q_heads={self.num_q_heads} and "
                f"intermediate={self.intermediate}"
            )
        self.shard_spec(tp).check()


@dataclass
class Batch:
    """One forward pass: tokens of several sequences, each a contiguous run.

    `tokens`, `positions`: [T]; `seq`, `slot`: [T] row of the token's sequence in `page_table`
    and its index among that sequence's new tokens; `page_table`: [B, max_pages] page ids (padded
    with any valid id); `kv_len`: [B] cached length after this pass (new tokens included).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    seq: torch.Tensor
    slot: torch.Tensor
    page_table: torch.Tensor
    kv_len: torch.Tensor
    q_max: int
    kv_max: int = 0  # longest kv_len, kept on the host (no device sync inside a forward)

    def to(self, device: torch.device) -> Batch:
        """The same batch with its tensors on `device` (itself where they already are)."""
        if self.tokens.device == device:
            return self
        return Batch(*(t.to(device) for t in (self.tokens, self.positions, self.seq, self.slot,
                                              self.page_table, self.kv_len)),
                     q_max=self.q_max, kv_max=self.kv_max)

    @staticmethod
    def build(
        runs: list[tuple[list[int], int, list[int]]], page_size: int
    ) -> Batch:
        """`runs`: (new tokens, start position, page ids) per sequence."""
        toks, pos, seq, slot = [], [], [], []
        width = max(len(p) for _, _, p in runs)
        table = torch.zeros(len(runs), max(width, 1), dtype=torch.long)
        kv_len = []
        for b, (t, start, pages) in enumerate(runs):
            n = len(t)
            need = -(-(start + n) // page_size)
            if need > len(pages):
                raise ValueError(f"sequence {b}: {start + n} tokens need {need} pages")
            toks += t
            pos += range(start, start + n)
            seq += [b] * n
            slot += range(n)
            table[b, : len(pages)] = torch.tensor(pages, dtype=torch.long)
            kv_len.append(start + n)
        return Batch(
            tokens=torch.tensor(toks, dtype=torch.long),
            positions=torch.tensor(pos, dtype=torch.long),
            seq=torch.tensor(seq, dtype=torch.long),
            slot=torch.tensor(slot, dtype=torch.long),
            page_table=table,
            kv_len=torch.tensor(kv_len, dtype=torch.long),
            q_max=max(len(t) for t, _, _ in runs),
            kv_max=max(kv_len),
        )


@dataclass
class TP:
    """This process's place in its instance's tensor-parallel group."""

    size: int = 1
    rank: int = 0
    group: object = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class _Rotary:
    """Rotate-half RoPE at one pass's positions: cos/sin are computed once per forward pass
    and applied to every layer's q and k, with the same values as computing them for each.
    With `PassTables`, the fused attention of `_attend` and the fused projections, a CPU
    decode step of the tiny-local model went from about 1,390 torch ops to 890 and took about
    half as long (docs/benchmark-rounds.md, "Seventh round"): on a CPU such small ops cost
    their dispatch, not their arithmetic, and a decode instance pays that cost cold."""

    def __init__(self, positions: torch.Tensor, dim: int, theta: float,
                 dtype: torch.dtype) -> None:
        inv = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device)
                        / dim)
        ang = positions.to(torch.float64)[:, None] * inv[None, :]
        self.cos, self.sin = ang.cos().to(dtype), ang.sin().to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ..., dim] rotated at the pass's positions."""
        d = x.shape[-1]
        shape = [x.shape[0]] + [1] * (x.dim() - 2) + [d // 2]
        cos, sin = self.cos.view(shape), self.sin.view(shape)
        a, b = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class PassTables:
    """What torch attention reads the same way in every layer of one forward pass: where each
    cached entry lives and which keys each query sees, built on first use, once per pass
    instead of once per layer (see `_Rotary`)."""

    def __init__(self, batch: Batch) -> None:
        self.batch = batch
        self._where: tuple[torch.Tensor, torch.Tensor] | None = None
        self._mask: torch.Tensor | None = None

    def where(self, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(page id, offset) of cached entry l of every sequence: [B, L] each, L = longest
        kv_len."""
        if self._where is None:
            b = self.batch
            pos = torch.arange(b.kv_max or int(b.kv_len.max()), device=b.page_table.device)
            pid = b.page_table[:, pos // page_size]
            self._where = pid, (pos % page_size).expand_as(pid)
        return self._where

    def mask(self) -> torch.Tensor:
        """[B, 1, q_max, L]: key position <= query position (causal, within kv_len)."""
        if self._mask is None:
            b = self.batch
            dev = b.positions.device
            qpos = torch.full((b.page_table.shape[0], b.q_max), -1, dtype=torch.long,
                              device=dev)
            qpos[b.seq, b.slot] = b.positions
            length = b.kv_max or int(b.kv_len.max())
            self._mask = (torch.arange(length, device=dev)[None, None, :]
                          <= qpos[:, :, None])[:, None]
        return self._mask


class _Weights:
    """Full weights drawn from the seed in a fixed order (identical on every rank)."""

    def __init__(self, cfg: TinyConfig) -> None:
        g = torch.Generator().manual_seed(cfg.seed)
        dt = cfg.torch_dtype

        def mat(n_in: int, n_out: int, gain: float = 1.0) -> torch.Tensor:
            w = torch.randn(n_in, n_out, generator=g, dtype=torch.float64)
            return (w * gain / math.sqrt(n_in)).to(dt)

        def norm(n: int) -> torch.Tensor:
            return (1.0 + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)).to(dt)

        h = cfg.hidden
        self.embed = torch.randn(VOCAB, h, generator=g, dtype=torch.float64).to(dt)
        self.layers: list[dict[str, torch.Tensor]] = []
        for _ in range(cfg.num_layers):
            lw: dict[str, torch.Tensor] = {"attn_norm": norm(h)}
            if cfg.attention == "gqa":
                lw["wq"] = mat(h, cfg.num_q_heads * cfg.head_dim, 2.0)
                lw["wk"] = mat(h, cfg.num_kv_heads * cfg.head_dim, 2.0)
                lw["wv"] = mat(h, cfg.num_kv_heads * cfg.head_dim)
                lw["wo"] = mat(cfg.num_q_heads * cfg.head_dim, h)
            else:
                qk = cfg.qk_nope_dim + cfg.qk_rope_dim
                lw["wq"] = mat(h, cfg.num_q_heads * qk, 2.0)
                lw["wkv_a"] = mat(h, cfg.kv_lora_rank + cfg.qk_rope_dim, 2.0)
                lw["kv_norm"] = norm(cfg.kv_lora_rank)
                lw["wkv_b"] = mat(
                    cfg.kv_lora_rank, cfg.num_q_heads * (cfg.qk_nope_dim + cfg.v_head_dim)
                )
                lw["wo"] = mat(cfg.num_q_heads * cfg.v_head_dim, h)
            lw["mlp_norm"] = norm(h)
            lw["w_gate"] = mat(h, cfg.intermediate)
            lw["w_up"] = mat(h, cfg.intermediate)
            lw["w_down"] = mat(cfg.intermediate, h)
            self.layers.append(lw)
        self.final_norm = norm(h)
        self.lm_head = mat(h, VOCAB, 4.0)
        self.mtp_norm_h = norm(h)
        self.mtp_norm_e = norm(h)
        self.mtp_proj = mat(2 * h, h)
        # Printable ASCII slightly favoured so the smoke output reads as text; EOS rare.
        bias = torch.zeros(VOCAB, dtype=torch.float64)
        bias[32:127] = 5.0
        bias[EOS] = -4.0
        self.logit_bias = bias.to(dt)


class TinyModel:
    """One TP rank's shard of the model. Stateless apart from weights: the cache is passed in.

    On the CPU (the default) attention is torch over the gathered pages and the progress word
    is the caller's `on_layer`. `to_device("cuda", ...)` moves the weights to the GPU, runs
    decode attention (one new token per request) through FlashInfer's paged decode wrapper
    over the same HND pages, and makes the GPU stream write the progress word itself.
    """

    device = torch.device("cpu")
    decode_attention: Any = None  # attention.FlashInferDecode on the cuda path
    progress_writer: Any = None  # transfer.progress.GpuProgressWriter on the cuda path

    def __init__(self, cfg: TinyConfig, tp: TP | None = None) -> None:
        self.cfg = cfg
        self.tp = tp or TP()
        cfg.check_tp(self.tp.size)
        full = _Weights(cfg)
        t, r = self.tp.size, self.tp.rank
        hq = cfg.num_q_heads // t
        self.q_heads = range(r * hq, (r + 1) * hq)
        self.kv_heads = cfg.shard_spec(t).heads_of(r)
        inter = cfg.intermediate // t
        ff = slice(r * inter, (r + 1) * inter)
        self.layers: list[dict[str, torch.Tensor]] = []
        for lw in full.layers:
            s = {k: lw[k] for k in ("attn_norm", "mlp_norm")}
            # projections that read the same input are one matmul each: gate and up; q, k
            # and v (GQA). Each output column is the same dot product; fewer ops per layer
            # (see _Rotary for why that counts on a CPU)
            s["w_gate_up"] = torch.cat([lw["w_gate"][:, ff], lw["w_up"][:, ff]], 1)
            s["w_down"] = lw["w_down"][ff, :].contiguous()
            if cfg.attention == "gqa":
                d = cfg.head_dim
                s["wqkv"] = torch.cat([_cols(lw["wq"], self.q_heads, d),
                                       _cols(lw["wk"], self.kv_heads, d),
                                       _cols(lw["wv"], self.kv_heads, d)], 1)
                s["wo"] = _rows(lw["wo"], self.q_heads, d)
            else:
                s["wq"] = _cols(lw["wq"], self.q_heads, cfg.qk_nope_dim + cfg.qk_rope_dim)
                s["wkv_a"], s["kv_norm"] = lw["wkv_a"], lw["kv_norm"]
                s["wkv_b"] = _cols(lw["wkv_b"], self.q_heads, cfg.qk_nope_dim + cfg.v_head_dim)
                s["wo"] = _rows(lw["wo"], self.q_heads, cfg.v_head_dim)
            self.layers.append(s)
        self.embed = full.embed
        self.final_norm = full.final_norm
        self.lm_head = full.lm_head
        self.logit_bias = full.logit_bias
        self.mtp = (full.mtp_norm_h, full.mtp_norm_e, full.mtp_proj)
        if cfg.attention == "gqa":
            check_head_groups(self.q_heads, self.kv_heads, cfg.num_q_heads // cfg.num_kv_heads)
        self.tokens_seen = 0  # every token any forward pass of this model has processed

    # -- device ----------------------------------------------------------------------------

    def to_device(self, device: str, page_size: int, progress: Any = None,
                  flashinfer: bool = True) -> TinyModel:
        """Move every weight to `device`. On cuda: GQA decode attention through FlashInfer
        (`attention.FlashInferDecode`, HND pages of `page_size`; `flashinfer=False` keeps
        torch's), and, given the prefill's `transfer.progress.ProgressWord`, its per-layer
        writes enqueued on the GPU stream."""
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        for name, value in list(vars(self).items()):
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(dev))
            elif isinstance(value, tuple) and value and all(
                    isinstance(v, torch.Tensor) for v in value):
                setattr(self, name, tuple(v.to(dev) for v in value))
        self.layers = [{k: v.to(dev) for k, v in lw.items()} for lw in self.layers]
        self.device = dev
        if dev.type == "cuda":
            from .attention import FlashInferDecode

            if self.cfg.attention == "gqa" and flashinfer:
                self.decode_attention = FlashInferDecode(
                    q_heads=len(self.q_heads), kv_heads=len(self.kv_heads),
                    head_dim=self.cfg.cache_dim, page_size=page_size,
                    kv_dtype=self.cfg.torch_kv_dtype, device=dev)
            if progress is not None:
                from transfer.progress import GpuProgressWriter

                self.progress_writer = GpuProgressWriter(progress)
        return self

    def _begin(self, batch: Batch) -> Batch:
        """The batch on this model's device; plans FlashInfer when every request of the pass
        has one new token (decode), which every layer's `_attend` then runs."""
        batch = batch.to(self.device)
        if self.decode_attention is not None and batch.q_max == 1:
            self.decode_attention.plan(batch.page_table, batch.kv_len)
        return batch

    def _layer_done(self, i: int, on_layer: Callable[[int], None] | None) -> None:
        """After layer i's attention output projection (and its all-reduce, so every TP
        rank's KV of the layer is in its cache): the progress word's layer field. One word,
        two writers: the GPU stream on cuda, else the caller's host callback."""
        if self.progress_writer is not None:
            self.progress_writer.layer_done(i)
        elif on_layer is not None:
            on_layer(i)

    def _end_pass(self) -> None:
        """Wait for the GPU stream when it writes the progress word: the next pass's
        `begin_pass` resets the word from the host, which must come after this pass's last
        layer write. Not while a CUDA graph is being captured (its replay is waited for by
        whoever replays it)."""
        if (self.progress_writer is not None and self.device.type == "cuda"
                and not torch.cuda.is_current_stream_capturing()):
            torch.cuda.current_stream().synchronize()

    # -- forward ---------------------------------------------------------------------------

    def forward(
        self,
        batch: Batch,
        cache: list[torch.Tensor],
        page_size: int,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run `batch`, append its K/V to `cache`, return final hidden states [T, hidden]
        (before the final norm). `on_layer(i)` runs once layer i's cache entries are written
        and its attention output projected (`_layer_done`)."""
        self.tokens_seen += int(batch.tokens.numel())
        batch = self._begin(batch)
        x = self.embed[batch.tokens]
        page = batch.page_table[batch.seq, batch.positions // page_size]
        off = batch.positions % page_size
        cfg = self.cfg
        tables = PassTables(batch)
        rotary = _Rotary(batch.positions, cfg.head_dim if cfg.attention == "gqa"
                         else cfg.qk_rope_dim, cfg.rope_theta, cfg.torch_dtype)
        for i, lw in enumerate(self.layers):
            a = _rms(x, lw["attn_norm"])
            if cfg.attention == "gqa":
                att = self._gqa(a, lw, tables, rotary, cache[i], page, off, page_size)
            else:
                att = self._mla(a, lw, tables, rotary, cache[i], page, off, page_size)
            x = x + self.tp.all_reduce(att @ lw["wo"])
            self._layer_done(i, on_layer)
            gate, up = (_rms(x, lw["mlp_norm"]) @ lw["w_gate_up"]).chunk(2, dim=-1)
            x = x + self.tp.all_reduce((torch.nn.functional.silu(gate) * up) @ lw["w_down"])
        self._end_pass()
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, vocab] on the host (the schedulers pick and sample there)."""
        return (_rms(hidden, self.final_norm) @ self.lm_head + self.logit_bias).cpu()

    def draft(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """MTP-style draft: from the hidden state at position i and the token at i+1, propose
        the token at i+2 (greedy). hidden [B, hidden], next_tokens [B] → [B]."""
        nh, ne, proj = self.mtp
        hidden, next_tokens = hidden.to(self.device), next_tokens.to(self.device)
        z = torch.cat([_rms(hidden, nh), _rms(self.embed[next_tokens], ne)], dim=-1) @ proj
        return self.logits(z).argmax(-1)

    # -- attention ---------------------------------------------------------------------------

    def _gather(self, buf: torch.Tensor, tables: PassTables, page_size: int) -> torch.Tensor:
        """Cached entries of every sequence: [B, L, parts, heads, dim] (L = longest kv_len)."""
        pid, off = tables.where(page_size)
        return buf[pid, :, :, off, :].to(self.cfg.torch_dtype)

    def _pad_q(self, q: torch.Tensor, batch: Batch) -> torch.Tensor:
        """[T, ...] → [B, q_max, ...] (padding rows are zero and masked out)."""
        out = q.new_zeros((batch.page_table.shape[0], batch.q_max, *q.shape[1:]))
        out[batch.seq, batch.slot] = q
        return out

    def _softmax_av(
        self, scores: torch.Tensor, v: torch.Tensor, tables: PassTables
    ) -> torch.Tensor:
        """scores [B, H, q, L], v [B, L, H, dv] → [T, H*dv]."""
        b = tables.batch
        scores = scores.masked_fill(~tables.mask(), float("-inf"))
        p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padding rows have no keys
        out = torch.einsum("bhql,blhd->bqhd", p, v)[b.seq, b.slot]
        return out.reshape(out.shape[0], -1)

    def _gqa(self, a, lw, tables, rotary, buf, page, off, page_size):
        t, d = a.shape[0], self.cfg.head_dim
        hq, hkv = len(self.q_heads), len(self.kv_heads)
        heads = (a @ lw["wqkv"]).view(t, hq + 2 * hkv, d)  # q heads, k heads, v heads
        qk = rotary(heads[:, : hq + hkv])  # one rotation for q and k
        q, k, v = qk[:, :hq], qk[:, hq:], heads[:, hq + hkv :]
        buf[page, 0, :, off, :] = k.to(buf.dtype)
        buf[page, 1, :, off, :] = v.to(buf.dtype)
        return self._attend(q, buf, tables, page_size)

    def _attend(self, q: torch.Tensor, buf: torch.Tensor, tables: PassTables,
                page_size: int) -> torch.Tensor:
        """GQA attention of q [T, hq, d] over the pages of `buf` ([pages, 2, hkv, P, d], this
        pass's K/V already written) → [T, hq*d]: FlashInfer for a decode pass on cuda
        (`_begin` planned it), else torch over the gathered pages."""
        d, batch = q.shape[-1], tables.batch
        if self.decode_attention is not None and batch.q_max == 1:
            return self.decode_attention.run(q, buf).reshape(q.shape[0], -1)
        kv = self._gather(buf, tables, page_size)  # [B, L, 2, hkv, d]
        keys, vals = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # [B, hkv, L, d]
        # one fused op for scores, mask, softmax and values: the same arithmetic as spelling
        # them out (float64 results agree to 1e-15) in under half the CPU time per layer; the
        # grouped query heads read their KV head without copies (check_head_groups)
        out = torch.nn.functional.scaled_dot_product_attention(
            self._pad_q(q, batch).transpose(1, 2), keys, vals, attn_mask=tables.mask(),
            scale=1.0 / math.sqrt(d), enable_gqa=True)
        out = out.transpose(1, 2)[batch.seq, batch.slot]  # padding rows (no keys) dropped
        return out.reshape(out.shape[0], -1)

    def _mla(self, a, lw, tables, rotary, buf, page, off, page_size):
        cfg, t, batch = self.cfg, a.shape[0], tables.batch
        rank, nope, rope, dv = cfg.kv_lora_rank, cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.v_head_dim
        q = (a @ lw["wq"]).view(t, -1, nope + rope)
        q_nope, q_rope = q[..., :nope], rotary(q[..., nope:])
        kv_a = a @ lw["wkv_a"]
        latent = _rms(kv_a[:, :rank], lw["kv_norm"])
        k_rope = rotary(kv_a[:, rank:])
        buf[page, 0, 0, off, :] = torch.cat([latent, k_rope], dim=-1).to(buf.dtype)
        cached = self._gather(buf, tables, page_size)[:, :, 0, 0, :]  # [B, L, rank+rope]
        b, length = cached.shape[:2]
        up = (cached[..., :rank] @ lw["wkv_b"]).view(b, length, -1, nope + dv)
        k_nope, vals = up[..., :nope], up[..., nope:]
        qn, qr = self._pad_q(q_nope, batch), self._pad_q(q_rope, batch)
        scores = torch.einsum("bqhd,blhd->bhql", qn, k_nope)
        scores = scores + torch.einsum("bqhd,bld->bhql", qr, cached[..., rank:])
        return self._softmax_av(scores / math.sqrt(nope + rope), vals, tables)


def check_head_groups(q_heads: range, kv_heads: range, group: int) -> None:
    """Local query head i must read local KV head i // (local q heads / local KV heads), the
    grouping `scaled_dot_product_attention(enable_gqa=True)` applies. Every split
    `ShardSpec.heads_of` makes (contiguous, or one replicated KV head per rank) has it: a
    layout without it is refused here rather than attended wrongly."""
    hq, hkv = len(q_heads), len(kv_heads)
    if hkv == 0 or hq % hkv or any(h // group - kv_heads.start != i // (hq // hkv)
                                   for i, h in enumerate(q_heads)):
        raise ValueError(f"query heads {q_heads} do not group over KV heads {kv_heads} "
                         f"({group} query heads per KV head)")


def _cols(w: torch.Tensor, heads: range, d: int) -> torch.Tensor:
    return w[:, heads.start * d : heads.stop * d].contiguous()


def _rows(w: torch.Tensor, heads: range, d: int) -> torch.Tensor:
    return w[heads.start * d : heads.stop * d, :].contiguous()
