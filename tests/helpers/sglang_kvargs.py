"""SGLang 0.5.23's KVArgs and write counts built the way its scheduler builds them.

`sglang_kvargs` fills a decode rank's `KVArgs` from SGLang's own pool and metadata classes on
the CPU (decode.py `_init_kv_manager`); `sglang_backend_writes` is what pdtool's backend arms
the rank's slot with for a prompt (`geometry.sglang_decode_writes`, as
`PdtoolKVReceiver.send_metadata` calls it). Used by tests/test_geometry.py and
tests/test_sglang_spec.py.
"""

from __future__ import annotations

from typing import Any

import sglang  # noqa: F401  (scripts/install.sh --test installs it: fail, never skip)

from pdtool.schema import Config
from transfer import geometry as G
from transfer.layout import sglang_buffer_layouts
from transfer.parallel import ParallelDims

SLOTS = 64  # pool size of the test buffers (the count does not depend on it)


def sglang_kvargs(cfg: Config, tp: int, sampling_mask: bool = False,
                  kv_checksum: bool = False) -> tuple[Any, Any]:
    """KVArgs of one decode rank of attention TP `tp`, filled from SGLang's own pool and
    metadata classes as its scheduler does (decode.py `_init_kv_manager`)."""
    import torch
    from sglang.srt.disaggregation.base import KVArgs
    from sglang.srt.disaggregation.utils import MetadataBuffers, get_kv_transfer_buf_infos
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    m, page = cfg.model, cfg.decode.page_size
    common = {"size": SLOTS, "page_size": page, "dtype": torch.bfloat16,
              "layer_num": m.num_layers, "device": "cpu", "enable_memory_saver": False}
    if m.attention == "mla":
        pool = MLATokenToKVPool(kv_lora_rank=m.kv_lora_rank,
                                qk_rope_head_dim=m.qk_rope_head_dim, **common)
    else:  # SGLang's per-rank KV heads: max(1, total // tp) (replicated below one per rank)
        pool = MHATokenToKVPool(head_num=max(1, m.num_kv_heads // tp), head_dim=m.head_dim,
                                enable_alt_stream=False, **common)
    # no speculative decoding: the scheduler's hidden-state row is 16 fp32 (RDMA padding)
    meta = MetadataBuffers(8, 16, torch.float32, G.SGLANG_SAMPLING_MASK_TOKENS,
                           kv_checksum_enabled=kv_checksum)
    args = KVArgs()
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = get_kv_transfer_buf_infos(pool)
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = meta.get_buf_infos()
    args.page_size = pool.page_size
    if m.attention != "mla":
        args.kv_head_num, args.total_kv_head_num = pool.head_num, m.num_kv_heads
    return args, (pool, meta)


def sglang_backend_writes(cfg: Config, tokens: int, decode_rank: int, **meta: bool) -> int:
    """What the backend's decode rank `decode_rank` arms its slot with for a `tokens` prompt."""
    import torch
    from sglang.srt.mem_cache.common import kv_to_page_indices

    p, d = ParallelDims(cfg.prefill.tp, cfg.prefill.dp, cfg.prefill.dp_attention), \
        ParallelDims(cfg.decode.tp, cfg.decode.dp, cfg.decode.dp_attention)
    args, _keep = sglang_kvargs(cfg, d.attn_tp, **meta)
    mla = cfg.model.attention == "mla"
    heads_local = 1 if mla else args.kv_head_num
    sglang_buffer_layouts(args.kv_data_lens, args.kv_item_lens, heads_local, args.page_size)
    first = 3 * args.page_size  # the request's slots start on some page boundary
    kv_indices = kv_to_page_indices(torch.arange(first, first + tokens), args.page_size)
    return G.sglang_decode_writes(
        is_mla=mla, total_heads=1 if mla else args.total_kv_head_num,
        prefill_tp=p.attn_tp, decode_tp=d.attn_tp, decode_rank=decode_rank,
        page_size=args.page_size, num_pages=len(kv_indices),
        num_buffers=len(args.kv_data_ptrs), num_aux=len(args.aux_data_ptrs),
    )
