"""KV geometry: how each engine keeps a rank's pages and metadata, and how many writes a request
costs. The one owner of the write count (`expected_writes`).

`pdtool plan`, the validate rules, the messenger and the SGLang backend all count with the
functions below, from the same data, so the figure `pdtool plan` prints is the figure a decoder
waits for.

Pools as data. A `PagePool` says, for one engine: the buffers of one layer (fused K/V, separate
K and V, or MLA's latent), the axes of one page of one buffer, outermost first, and whether the
engine sends the KV of the last prompt token. From the axes follows how many contiguous runs a
head slice of a page is (`PagePool.runs_per_page`): the product of the axes outside `heads`.

  messenger HND   buffer per layer [pages, parts, heads, tokens, dim]  parts 2 (K,V) or 1 (MLA);
                  FlashInfer's HND paged cache, so a partial head slice is 2 runs (K, V)
  messenger NHD   buffer per layer [pages, tokens, heads, parts, dim]  one run per token
  sglang MHA      K and V buffers per layer, [slots, heads, dim]; page p = slots [pP, (p+1)P)
  sglang MLA      one latent buffer per layer, [slots, 1, kv_lora_rank + rope]

SGLang's pools are NHD, yet pdtool's SGLang backend never writes a head slice token by token:
where a slice of a page is not contiguous it gathers the slice into a registered staging buffer
first (`transfer/sglang/staging_plane.py`), so each (page, layer buffer, source shard) is one
write (`PagePool.packed_slices`).

A speculative draft model with a KV pool of its own adds SGLang buffers after the target's
(`KVArgs.num_draft_entries`), sharded over the same attention TP but with heads of its own:
they form a second `KVGroup` whose slices follow from the bytes a token takes in them on each
side (`sglang_draft_group`), counted beside the target's (`sglang_decode_writes(draft=)`).

The messenger stops one token short (decode recomputes the last prompt token: its first decode
step); SGLang's decoder allocates, and its prefill sends, every prompt token's KV
(`kv_to_page_indices` of the whole prompt).

Metadata as data. `AuxBuffer` is one row-per-request buffer sent once per request after the
last chunk. The reference engine has one (the last hidden state); SGLang 0.5.23 registers every
buffer of its `MetadataBuffers` (`sglang_metadata_buffers`, in `get_buf_infos` order), and the
backend writes one row of each.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .routes import LAYOUTS, RouteError, ShardSpec, Slice, pages_for, routes_for


# --------------------------------------------------------------------------- page pools
@dataclass(frozen=True)
class PagePool:
    """How an engine keeps one rank's KV pages.

    `axes` names the dimensions of ONE page of one buffer, outermost first: `heads`, `tokens`
    (the page size), `parts` (K and V fused per head entry) and `dim`. `layout` is the
    `transfer.layout.KVLayout` kind that computes its byte offsets. `buffers` names the buffers
    of one layer in registration order within the layer.
    """

    name: str
    layout: str
    axes: tuple[str, ...]
    buffers: tuple[str, ...]
    parts: int
    whole_prompt: bool
    # the sender packs a page's head slice into one contiguous run before writing it (a
    # staging gather), whatever the pool's axes: one write per (page, buffer, slice)
    packed_slices: bool = False

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise RouteError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if "heads" not in self.axes:
            raise RouteError(f"pool {self.name}: axes {self.axes} have no `heads` axis")

    @property
    def buffers_per_layer(self) -> int:
        return len(self.buffers)

    def runs_per_page(self, page_size: int) -> int:
        """Contiguous runs a partial head slice of one page is: the axes outside `heads`
        (1 when the sender packs slices into staging first)."""
        if self.packed_slices:
            return 1
        sizes = {"tokens": page_size, "parts": self.parts}
        outer = self.axes[: self.axes.index("heads")]
        return math.prod(sizes.get(a, 1) for a in outer)

    def pages_for(self, num_tokens: int, page_size: int) -> int:
        """Pages a prompt of `num_tokens` sends into."""
        if self.whole_prompt:
            return math.ceil(max(num_tokens, 0) / page_size)
        return pages_for(num_tokens, page_size)


#: The axes of one page of the messenger's buffers, per `transfer.layout`; `transfer.layout`
#: computes its byte offsets from these. HND is FlashInfer's `[pages, 2, kv_heads, page_size,
#: head_dim]` (K part then V part), so a head slice of a fused page is two contiguous runs.
MESSENGER_AXES = {
    "HND": ("parts", "heads", "tokens", "dim"),
    "NHD": ("tokens", "heads", "parts", "dim"),
}


def messenger_pool(layout: str, mla: bool = False, kv_parts: int | None = None) -> PagePool:
    """pdtool's messenger (reference engine): one buffer per layer, K and V fused (HND: K of
    every local head, then V; NHD: K and V side by side per head and token). `kv_parts=1`
    without `mla`: K and V in buffers of their own (FlashInfer's `(k_cache, v_cache)`)."""
    if layout not in MESSENGER_AXES:
        raise RouteError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    parts = (1 if mla else 2) if kv_parts is None else kv_parts
    buffers = ("latent",) if mla else (("KV",) if parts == 2 else ("K", "V"))
    return PagePool(f"messenger {layout}", layout, MESSENGER_AXES[layout], buffers, parts,
                    whole_prompt=False)


def sglang_pool(mla: bool) -> PagePool:
    """SGLang 0.5.23's device pools: NHD slot rows, K and V apart (MLA: one latent buffer).
    pdtool's backend packs a partial head slice of a page into staging before writing it
    (`packed_slices`), so a TP mismatch costs one write per page and source shard, not one per
    token."""
    return PagePool("sglang MLA" if mla else "sglang MHA", "NHD", ("tokens", "heads", "dim"),
                    ("latent",) if mla else ("K", "V"), 1, whole_prompt=True, packed_slices=True)


def _pool(layout: str | PagePool) -> PagePool:
    return layout if isinstance(layout, PagePool) else messenger_pool(layout)


# --------------------------------------------------------------------------- metadata buffers
@dataclass(frozen=True)
class AuxBuffer:
    """One metadata buffer: a row of `row` elements of `itemsize` bytes per request slot."""

    name: str
    row: int
    itemsize: int

    @property
    def row_bytes(self) -> int:
        return self.row * self.itemsize


def reference_aux(hidden_size: int) -> tuple[AuxBuffer, ...]:
    """The reference engine's one metadata buffer: the last hidden state, fp32."""
    return (AuxBuffer("hidden_state", hidden_size, 4),)


#: SGLang's default `--sampling-mask-max-tokens` (only sized rows, never the count).
SGLANG_SAMPLING_MASK_TOKENS = 4096
#: The hidden-state row without a draft that carries one: 16 fp32, SGLang's RDMA padding.
SGLANG_HIDDEN_PAD = (16, 4)

#: `--speculative-algorithm` names SGLang 0.5.23 knows (`SpeculativeAlgorithm`, upper-cased;
#: NEXTN is its alias of EAGLE).
SGLANG_SPEC_ALGORITHMS = frozenset({"EAGLE", "NEXTN", "EAGLE3", "FROZEN_KV_MTP", "STANDALONE",
                                    "NGRAM", "DFLASH", "DSPARK", "UNO"})
#: Those whose PD path carries the draft's hidden state and top-k in the metadata buffers
#: (`SpeculativeAlgorithm.carries_draft_hidden_states`, the EAGLE family): the scheduler then
#: sizes `output_hidden_states` at the draft's `spec_hidden_size` in the model's dtype.
SGLANG_SPEC_HIDDEN_STATES = frozenset({"EAGLE", "NEXTN", "EAGLE3", "FROZEN_KV_MTP"})
#: Those whose draft model keeps a KV pool of its own, which SGLang's prefill appends to the
#: target's KV buffers (`BaseSpecWorker.primary_draft_kv_pool`, `KVArgs.num_draft_entries`).
#: NGRAM and UNO have no draft model; FROZEN_KV_MTP's draft reads the target's KV.
SGLANG_SPEC_DRAFT_KV = frozenset({"EAGLE", "NEXTN", "EAGLE3", "STANDALONE", "DFLASH", "DSPARK"})
#: Those of them pdtool's SGLang backend carries: the draft pool is an ordinary MHA or MLA pool
#: over the target's attention TP (`sglang_draft_group`). DFLASH's and DSPARK's follow rules of
#: their own and stay refused.
SGLANG_SPEC_DRAFT_KV_CARRIED = frozenset({"EAGLE", "NEXTN", "EAGLE3", "STANDALONE"})


def sglang_hidden_row(speculative: str | None, hidden_size: int,
                      itemsize: int) -> tuple[int, int]:
    """(elements, bytes each) of one `output_hidden_states` row, as SGLang's scheduler sizes it:
    the draft's hidden state (`hidden_size` x `itemsize`) for the algorithms that carry one,
    else the 16 fp32 padding."""
    if speculative and speculative.upper() in SGLANG_SPEC_HIDDEN_STATES:
        return hidden_size, itemsize
    return SGLANG_HIDDEN_PAD


def sglang_metadata_buffers(*, sampling_mask: bool = False,
                            max_sampling_mask_tokens: int = SGLANG_SAMPLING_MASK_TOKENS,
                            dsa_topk_dim: int = 0, kv_checksum: bool = False,
                            hidden_size: int = 16, hidden_itemsize: int = 4,
                            max_top_logprobs: int = 128) -> tuple[AuxBuffer, ...]:
    """SGLang 0.5.23 `MetadataBuffers.get_buf_infos()`, as data, in its order.

    Optional buffers follow SGLang's switches: `SGLANG_ENABLE_DISAGG_SAMPLING_MASK` (three
    sampling-mask buffers), a DSA model (`output_dsa_topk_indices`) and
    `--disaggregation-enable-kv-checksum` (`kv_checksum`). The buffers are the same with and
    without speculative decoding (top-k and hidden state are always registered): only the
    hidden-state row changes, `sglang_hidden_row` (16 fp32 without a draft hidden state).
    """
    i32, f32, i64, u64 = 4, 4, 8, 8
    out = [AuxBuffer("output_ids", 16, i32), AuxBuffer("cached_tokens", 16, i32),
           AuxBuffer("output_token_logprobs_val", 16, f32),
           AuxBuffer("output_token_logprobs_idx", 16, i32),
           AuxBuffer("output_top_logprobs_val", max_top_logprobs, f32),
           AuxBuffer("output_top_logprobs_idx", max_top_logprobs, i32)]
    if sampling_mask:
        out += [AuxBuffer("output_token_sampling_mask_len", 16, i32),
                AuxBuffer("output_token_sampling_mask_idx", max_sampling_mask_tokens, i32),
                AuxBuffer("output_token_sampling_logprobs", max_sampling_mask_tokens, f32)]
    out += [AuxBuffer("output_topk_p", 16, f32), AuxBuffer("output_topk_index", 16, i64),
            AuxBuffer("output_hidden_states", hidden_size, hidden_itemsize)]
    if dsa_topk_dim > 0:
        out.append(AuxBuffer("output_dsa_topk_indices", dsa_topk_dim, i32))
    out.append(AuxBuffer("bootstrap_room", 8, u64))
    if kv_checksum:
        out.append(AuxBuffer("kv_checksum", 8, u64))
    return tuple(out)


# --------------------------------------------------------------------------- write counts
def writes_per_page(sl: Slice, src: ShardSpec, dst: ShardSpec, layout: str | PagePool,
                    page_size: int) -> int:
    """RMA writes one slice needs per page and per layer buffer.

    A slice covering every local head on both sides is one contiguous page; a partial head run
    is `PagePool.runs_per_page` writes (HND: one per part, 2 for fused K/V, 1 for a latent;
    NHD: one per token; a pool whose sender packs slices into staging: 1).
    """
    pool = _pool(layout)
    whole = sl.num_heads == src.heads_per_rank == dst.heads_per_rank
    return 1 if whole else pool.runs_per_page(page_size)


def slice_ops(sl: Slice, src: ShardSpec, dst: ShardSpec, *, layout: str | PagePool,
              page_size: int, num_pages: int, writes_per_op: int = 1) -> int:
    """Completions one slice produces per layer buffer for a request of `num_pages` pages.

    Its writes, in page order, go `writes_per_op` to an operation (one fi_writemsg with an iov
    per write, one CQ entry on each side); operation boundaries sit at multiples of
    `writes_per_op` from the first write, so the count does not depend on how the prompt was
    chunked. 1 = one operation per write.
    """
    if writes_per_op < 1:
        raise RouteError(f"writes_per_op must be >= 1, got {writes_per_op}")
    writes = num_pages * writes_per_page(sl, src, dst, layout, page_size)
    return -(-writes // writes_per_op)


def expected_writes(slices: Sequence[Slice], src: ShardSpec, dst: ShardSpec, *,
                    layout: str | PagePool, page_size: int, num_pages: int, num_layers: int,
                    buffers_per_layer: int = 1, aux_writes: int = 0,
                    writes_per_op: int = 1) -> int:
    """Completions a decode rank counts before a request is complete.

    With one write per operation: pages × layers × layer buffers × Σ_slices(writes per page) +
    one write per metadata buffer. With `writes_per_op` > 1 each slice's writes per layer
    buffer are grouped (`slice_ops`); metadata copies stay one operation each.
    """
    per_buffer = sum(slice_ops(s, src, dst, layout=layout, page_size=page_size,
                               num_pages=num_pages, writes_per_op=writes_per_op)
                     for s in slices)
    return num_layers * buffers_per_layer * per_buffer + aux_writes


# --------------------------------------------------------------------------- SGLang's shards
def sglang_specs(is_mla: bool, total_heads: int, src_tp: int,
                 dst_tp: int) -> tuple[ShardSpec, ShardSpec]:
    """Shard specs of both sides from SGLang's attention TP sizes (MLA: one latent head)."""
    heads = 1 if is_mla else total_heads
    return ShardSpec(heads, src_tp), ShardSpec(heads, dst_tp)


def sglang_slices(is_mla: bool, total_heads: int, prefill_tp: int, decode_tp: int,
                  decode_rank: int) -> list[Slice]:
    """Head slices decode rank `decode_rank` receives (MLA: one, from whichever rank SGLang
    marked real; the prefill side uses the same function, so both agree on the count). A head
    replicated on several prefill ranks comes from the first one SGLang connects the decode
    rank to: with fewer KV heads than decode ranks (1 head, TP4 -> TP2: decode rank 1 is
    connected to prefill ranks 2 and 3) the first holder overall may not be one of them."""
    src, dst = sglang_specs(is_mla, total_heads, prefill_tp, decode_tp)
    return routes_for(src, dst, decode_rank,
                      allowed=sglang_connected_ranks(prefill_tp, decode_tp, decode_rank))


# --------------------------------------------------------------------------- draft-model KV
@dataclass(frozen=True)
class KVGroup:
    """A run of consecutive SGLang KV buffers that shard alike over attention TP.

    SGLang registers the target pool's buffers (every layer's K, then every V; MLA: one latent
    per layer) and, with a draft model that keeps its own pool (EAGLE/NEXTN, EAGLE3,
    STANDALONE), the draft pool's after them (`KVArgs.num_draft_entries`), addressed with the
    target's page ids. `heads` counts head units over the whole attention TP group. `whole`:
    every rank that SGLang connects a decode rank to holds the same bytes of this group, so it
    is sent as whole pages by one of them (`sglang_source_rank`).
    """

    name: str
    count: int
    heads: int
    whole: bool = False

    def specs(self, prefill_tp: int, decode_tp: int) -> tuple[ShardSpec, ShardSpec]:
        return ShardSpec(self.heads, prefill_tp), ShardSpec(self.heads, decode_tp)


def sglang_connected_ranks(prefill_tp: int, decode_tp: int, decode_rank: int) -> range:
    """The prefill attention ranks SGLang connects decode rank `decode_rank` to, and so the
    only ones that get its META (`CommonKVManager._resolve_rank_mapping`: its
    `target_tp_ranks`)."""
    first = sglang_source_rank(prefill_tp, decode_tp, decode_rank)
    return range(first, first + max(1, prefill_tp // decode_tp))


def sglang_source_rank(prefill_tp: int, decode_tp: int, decode_rank: int) -> int:
    """The first prefill attention rank SGLang connects decode rank `decode_rank` to
    (`CommonKVManager._resolve_rank_mapping`'s `target_tp_rank`)."""
    if decode_tp >= prefill_tp:
        return decode_rank // (decode_tp // prefill_tp)
    return decode_rank * (prefill_tp // decode_tp)


def sglang_draft_group(count: int, prefill_token_bytes: int, decode_token_bytes: int,
                       prefill_tp: int, decode_tp: int, *,
                       target_mla: bool = False) -> tuple[KVGroup, int]:
    """The draft pool's buffers as a KVGroup, and the bytes of one of its head units per token,
    from the bytes ONE token takes in one draft buffer on each side (item length / page size).

    The draft's KV heads are sharded over the same attention TP as the target's, in rank order,
    each rank holding `max(1, heads / tp)` of them (SGLang's rule), so only two cases can be
    told apart from the bytes alone, whatever the draft's head count and head size:
      * the same bytes on both sides: with equal TP a rank's page is the peer rank's page; with
        different TP every head is held by fewer ranks than either side has, and every prefill
        rank a decode rank is connected to holds exactly the decode rank's heads: whole pages
        from one of them (`whole`; an MLA draft's replicated latent is this case);
      * the whole token row split without replicas on both sides (prefill bytes × prefill TP
        == decode bytes × decode TP): head slices, in units of gcd(bytes) (any unit dividing
        both shards addresses the same bytes of the row).
    Anything else (a draft whose heads are replicated on one side only) cannot be sliced
    consistently under this TP mismatch: RouteError naming it. A sharded draft beside an MLA
    target with prefill TP > decode TP is refused too: SGLang lets only one of the prefill
    ranks connected to a decode rank send (the latent is replicated), and it holds only part
    of the draft's heads."""
    if count < 1:
        raise RouteError(f"draft KV: {count} buffers")
    p, d = prefill_token_bytes, decode_token_bytes
    if p < 1 or d < 1:
        raise RouteError(f"draft KV: {p} B per token on the prefill, {d} B on the decode")
    if p == d:
        return KVGroup("draft", count, 1, whole=True), p
    if p * prefill_tp != d * decode_tp:
        raise RouteError(
            f"draft KV: {p} B per token on each of {prefill_tp} prefill ranks, {d} B on each of "
            f"{decode_tp} decode ranks: its heads are replicated on one side only, which "
            f"cannot be head-sliced consistently under this TP mismatch (give both sides the "
            f"same attention TP, or a TP no larger than the draft's KV head count on both)")
    if target_mla and prefill_tp > decode_tp:
        raise RouteError(
            f"draft KV sharded over heads beside an MLA target: with prefill TP {prefill_tp} > "
            f"decode TP {decode_tp} one prefill rank per request sends (the latent is "
            f"replicated) and it holds only part of the draft's heads (give both sides the "
            f"same attention TP)")
    unit = math.gcd(p, d)
    return KVGroup("draft", count, p * prefill_tp // unit), unit


def sglang_group_slices(group: KVGroup, prefill_tp: int, decode_tp: int,
                        decode_rank: int) -> list[Slice]:
    """Head slices decode rank `decode_rank` receives of one KV group (in its head units)."""
    if group.whole:
        return [Slice(sglang_source_rank(prefill_tp, decode_tp, decode_rank), decode_rank,
                      0, 1, 0, 0)]
    src, dst = group.specs(prefill_tp, decode_tp)
    return routes_for(src, dst, decode_rank,
                      allowed=sglang_connected_ranks(prefill_tp, decode_tp, decode_rank))


def sglang_decode_writes(*, is_mla: bool, total_heads: int, prefill_tp: int, decode_tp: int,
                         decode_rank: int, page_size: int, num_pages: int, num_buffers: int,
                         num_aux: int, writes_per_op: int = 1,
                         draft: KVGroup | None = None) -> int:
    """What the SGLang backend's decode rank waits for, from what it registered: `num_buffers`
    KV buffers (len(KVArgs.kv_data_ptrs): every layer's K and V, or latent, the draft pool's
    included) and `num_aux` metadata buffers (len(KVArgs.aux_data_ptrs)), for `num_pages`
    allocated pages, with page writes grouped `writes_per_op` to an operation (the smaller iov
    limit of the two ranks' providers; 1 on efa). `draft`: the last `draft.count` buffers are
    a draft model's (`sglang_draft_group`), counted with their own slices."""
    ndraft = draft.count if draft is not None else 0
    src, dst = sglang_specs(is_mla, total_heads, prefill_tp, decode_tp)
    pool = sglang_pool(is_mla)
    total = expected_writes(routes_for(src, dst, decode_rank), src, dst, layout=pool,
                            page_size=page_size, num_pages=num_pages, num_layers=1,
                            buffers_per_layer=num_buffers - ndraft, aux_writes=num_aux,
                            writes_per_op=writes_per_op)
    if draft is not None:
        dsrc, ddst = draft.specs(prefill_tp, decode_tp)
        total += expected_writes(sglang_group_slices(draft, prefill_tp, decode_tp, decode_rank),
                                 dsrc, ddst, layout=pool, page_size=page_size,
                                 num_pages=num_pages, num_layers=1, buffers_per_layer=ndraft,
                                 writes_per_op=writes_per_op)
    return total
