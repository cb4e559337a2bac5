"""`pdtool bench`: an OpenAI-compatible load against a deployment, and what it measured.

Small modules, each one idea: `args` (the command's options and their checks, which validate
uses too for `launcher.benchmark`), `lengths` (seeded length distributions and prompts),
`load` (the async client driving a concurrency- or rate-bound load), `stats` (percentiles,
goodput and the prefill:decode ratio advice, pure functions over the request records),
`report` (table and JSON) and `plot` (the PNG). Only `load` and `plot` import their heavy
dependencies (`openai`, `matplotlib`, the `load` extra), and only when called.
"""
