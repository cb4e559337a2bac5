"""pdtool's reference CPU engine: a real producer and consumer of KV pages for the messenger.

Modules, in the order a request meets them:
  tokens    byte-level tokens (torch-free: the front imports it)
  tokenizer text <-> ids for the front: bytes, or a checkpoint's tokenizer.json + chat template
  api       the OpenAI request bodies, checked field by field, and the response bodies
  model     the tiny tensor-parallel transformer (GQA or MLA latent cache), weights from a seed
  checkpoint a checkpoint folder's config.json, read and checked (torch-free)
  hf        a Llama / Qwen2 / Qwen3 checkpoint as a tensor-parallel model (transformers' numerics)
  models    which model a RankSpec describes, and building one rank of it
  cache     the paged KV cache (HND or NHD, transfer.layout) and its page allocator
  heap      the C heap of a CPU rank: a pass's freed temporaries stay mapped
  oracle    single-process greedy generation: what disaggregated serving must equal
  engine    prefill (chunked, per-layer progress), decode (continuous batching) and
            aggregated (both on one instance) schedulers
  link      the schedulers' side of transfer.messenger
  wire      signed front ↔ decode messages
  front     the OpenAI HTTP front (/v1/completions, /v1/chat/completions, streaming)
  health    /health and /stats of each instance lead
  spec      RankSpec: one process's share of the plan, plain data
  serve     the serving processes and the worker entry's hook (run_worker)
  fromplan  plan → RankSpec for the worker entry
  local     start a deployment from RankSpecs (the engine's tests)
  client    a streaming OpenAI client measuring TTFT/TPOT (`pdtool launch --smoke`)
"""
