"""A Hugging Face checkpoint (Llama, Qwen2, Qwen3) as a tensor-parallel reference model.

The same serving code runs it as the built-in tiny model (model.py): same paged KV cache, same
`forward(batch, cache, page_size, on_layer)`, same TP split (query heads and the MLP's
intermediate columns per rank, KV heads per `ShardSpec.heads_of`, an all-reduce after the
attention output and the MLP). What differs is where the weights come from (`*.safetensors`,
read with `safetensors`) and the numerics, which follow transformers' own modules so greedy
output matches `transformers`' `generate` token for token:

* RMSNorm computes in float32 and casts back (LlamaRMSNorm), weights applied after the cast;
* RoPE's inverse frequencies (default, linear, llama3) and cos/sin tables are float32, as
  transformers' rotary embedding computes them whatever the model dtype, then cast;
* everything else runs in float64 (transformers' oracle is loaded as float64 too), so batching,
  chunking and TP change the sums only at 1e-16; the KV cache is `kv_dtype` (float32 default).

There is no draft head: `draft` returns None and the decoder's first step runs the last prompt
token alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pdtool.arch import Arch, read_arch
from transfer.routes import ShardSpec

from .model import _DTYPES, TP, Batch, PassTables, TinyModel, _cols, _rows, check_head_groups
from .tokenizer import eos_ids


@dataclass(frozen=True)
class HFConfig:
    """What the engine runs for `model.path`: the checkpoint's architecture + cache dtype."""

    path: str
    arch: Arch
    kv_dtype: str = "float32"
    dtype: str = "float64"
    attention: str = "gqa"
    kv_parts: int = 2

    @staticmethod
    def load(path: str, kv_dtype: str = "float32") -> HFConfig:
        return HFConfig(path=str(path), arch=read_arch(path), kv_dtype=kv_dtype)

    @property
    def num_layers(self) -> int:
        return self.arch.num_layers

    @property
    def hidden(self) -> int:
        return self.arch.hidden

    @property
    def num_q_heads(self) -> int:
        return self.arch.num_q_heads

    @property
    def cache_heads(self) -> int:
        return self.arch.num_kv_heads

    @property
    def max_context(self) -> int:
        """max_position_embeddings: the front refuses requests longer than this."""
        return self.arch.max_context

    @property
    def cache_dim(self) -> int:
        return self.arch.head_dim

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        return _DTYPES[self.kv_dtype]

    def shard_spec(self, tp: int) -> ShardSpec:
        return ShardSpec(num_kv_heads=self.arch.num_kv_heads, tp=tp)

    def check_tp(self, tp: int) -> None:
        a = self.arch
        if tp < 1 or a.num_q_heads % tp or a.intermediate % tp:
            raise ValueError(f"tp={tp} must divide the checkpoint's num_attention_heads="
                             f"{a.num_q_heads} and intermediate_size={a.intermediate}")
        self.shard_spec(tp).check()


def inv_freq(a: Arch) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim/2], float32, as transformers computes them."""
    d = a.head_dim
    inv = 1.0 / (a.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(torch.float) / d))
    if a.rope_type == "linear":
        return inv / a.rope_factor
    if a.rope_type == "llama3":
        low_wavelen = a.rope_original_max / a.rope_low_freq_factor
        high_wavelen = a.rope_original_max / a.rope_high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / a.rope_factor, inv)
        smooth = (a.rope_original_max / wavelen - a.rope_low_freq_factor) / (
            a.rope_high_freq_factor - a.rope_low_freq_factor)
        smoothed = (1 - smooth) * scaled / a.rope_factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


def _rms32(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: float32 inside, weight applied in the input dtype."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _load_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


class HFModel(TinyModel):
    """One TP rank's shard of a checkpoint (attention helpers shared with TinyModel)."""

    def __init__(self, cfg: HFConfig, tp: TP | None = None) -> None:
        self.cfg = cfg
        self.tp = tp or TP()
        cfg.check_tp(self.tp.size)
        a = cfg.arch
        self.arch = a
        w = _load_weights(Path(cfg.path))
        dt = cfg.torch_dtype
        t, r = self.tp.size, self.tp.rank
        hq = a.num_q_heads // t
        self.q_heads = range(r * hq, (r + 1) * hq)
        self.kv_heads = cfg.shard_spec(t).heads_of(r)
        inter = a.intermediate // t
        ff = slice(r * inter, (r + 1) * inter)
        d = a.head_dim

        def get(name: str) -> torch.Tensor:
            if name not in w:
                raise ValueError(f"model.path: {cfg.path} has no tensor {name!r}")
            return w[name].to(dt)

        def heads_bias(name: str, heads: range) -> torch.Tensor:
            return get(name)[heads.start * d : heads.stop * d].contiguous()

        self.layers = []
        for i in range(a.num_layers):
            p = f"model.layers.{i}."
            s = {"attn_norm": get(p + "input_layernorm.weight"),
                 "mlp_norm": get(p + "post_attention_layernorm.weight"),
                 "wq": _cols(get(p + "self_attn.q_proj.weight").T, self.q_heads, d),
                 "wk": _cols(get(p + "self_attn.k_proj.weight").T, self.kv_heads, d),
                 "wv": _cols(get(p + "self_attn.v_proj.weight").T, self.kv_heads, d),
                 "wo": _rows(get(p + "self_attn.o_proj.weight").T, self.q_heads, d),
                 "w_gate": get(p + "mlp.gate_proj.weight").T[:, ff].contiguous(),
                 "w_up": get(p + "mlp.up_proj.weight").T[:, ff].contiguous(),
                 "w_down": get(p + "mlp.down_proj.weight").T[ff, :].contiguous()}
            if a.qkv_bias:
                s["bq"] = heads_bias(p + "self_attn.q_proj.bias", self.q_heads)
                s["bk"] = heads_bias(p + "self_attn.k_proj.bias", self.kv_heads)
                s["bv"] = heads_bias(p + "self_attn.v_proj.bias", self.kv_heads)
            if a.o_bias:
                s["bo"] = get(p + "self_attn.o_proj.bias")
            if a.mlp_bias:
                s["b_gate"] = get(p + "mlp.gate_proj.bias")[ff].contiguous()
                s["b_up"] = get(p + "mlp.up_proj.bias")[ff].contiguous()
                s["b_down"] = get(p + "mlp.down_proj.bias")
            if a.qk_norm:
                s["q_norm"] = get(p + "self_attn.q_norm.weight")
                s["k_norm"] = get(p + "self_attn.k_norm.weight")
            self.layers.append(s)
        self.embed = get("model.embed_tokens.weight")
        self.final_norm = get("model.norm.weight")
        head = self.embed if a.tied or "lm_head.weight" not in w else get("lm_head.weight")
        self.lm_head = head.T.contiguous()
        self.inv_freq = inv_freq(a)
        check_head_groups(self.q_heads, self.kv_heads, a.num_q_heads // a.num_kv_heads)
        self.eos_ids = frozenset(eos_ids(Path(cfg.path)))
        self.tokens_seen = 0

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] at the pass's positions, once per forward pass."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # float32, as transformers
        emb = torch.cat((freqs, freqs), dim=-1)
        dt = self.cfg.torch_dtype
        return emb.cos().to(dt)[:, None, :], emb.sin().to(dt)[:, None, :]

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def forward(self, batch: Batch, cache: list[torch.Tensor], page_size: int,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        self.tokens_seen += int(batch.tokens.numel())
        batch = self._begin(batch)
        eps = self.arch.rms_eps
        x = self.embed[batch.tokens]
        page = batch.page_table[batch.seq, batch.positions // page_size]
        off = batch.positions % page_size
        tables, rope = PassTables(batch), self._rope_tables(batch.positions)
        for i, lw in enumerate(self.layers):
            att = self._attention(_rms32(x, lw["attn_norm"], eps), lw, tables, rope, cache[i],
                                  page, off, page_size)
            out = self.tp.all_reduce(att @ lw["wo"])
            x = x + (out + lw["bo"] if "bo" in lw else out)
            self._layer_done(i, on_layer)
            m = _rms32(x, lw["mlp_norm"], eps)
            gate, up = m @ lw["w_gate"], m @ lw["w_up"]
            if "b_gate" in lw:
                gate, up = gate + lw["b_gate"], up + lw["b_up"]
            down = self.tp.all_reduce((torch.nn.functional.silu(gate) * up) @ lw["w_down"])
            x = x + (down + lw["b_down"] if "b_down" in lw else down)
        self._end_pass()
        return x

    def _attention(self, a, lw, tables, rope, buf, page, off, page_size):
        t, d, eps = a.shape[0], self.arch.head_dim, self.arch.rms_eps
        q, k, v = a @ lw["wq"], a @ lw["wk"], a @ lw["wv"]
        if "bq" in lw:
            q, k, v = q + lw["bq"], k + lw["bk"], v + lw["bv"]
        q, k, v = q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d)
        if "q_norm" in lw:  # Qwen3: per-head RMSNorm of q and k before RoPE
            q, k = _rms32(q, lw["q_norm"], eps), _rms32(k, lw["k_norm"], eps)
        q, k = self._rope(q, *rope), self._rope(k, *rope)
        buf[page, 0, :, off, :] = k.to(buf.dtype)
        buf[page, 1, :, off, :] = v.to(buf.dtype)
        return self._attend(q, buf, tables, page_size)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (_rms32(hidden, self.final_norm, self.arch.rms_eps) @ self.lm_head).cpu()

    def draft(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """No draft head in these checkpoints."""
        return None
