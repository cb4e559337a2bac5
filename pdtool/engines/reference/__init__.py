"""pdtool's reference CPU engine: a real producer and consumer of KV pages for the messenger.

Modules, in the order a request meets them:
  tokens    byte-level tokens (torch-free: the front imports it)
  model     the tiny tensor-parallel transformer (GQA or MLA latent cache), weights from a seed
  cache     the paged HND KV cache and its page allocator
  oracle    single-process greedy generation: what disaggregated serving must equal
  engine    prefill (chunked, per-layer progress) and decode (continuous batching) schedulers
  link      the schedulers' side of transfer.messenger
  wire      signed front ↔ decode messages
  front     the OpenAI-style HTTP front (/v1/completions, streaming)
  health    /health and /stats of each instance lead
  serve     the serving processes and the worker entry's hook (run_worker)
  fromplan  plan → RankSpec for the worker entry
  local     start a deployment from RankSpecs (the engine's tests)
  client    a streaming OpenAI client measuring TTFT/TPOT (`pdtool launch --smoke`)
"""
