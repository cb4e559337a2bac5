"""SGLang integration: pdtool's libfabric KV transfer as a disaggregation backend `pdtool`.

Pinned to SGLang 0.5.23 (its transfer-backend interface changes between 0.5.x releases).
`plugin.register` is the `sglang.srt.plugins` entry point that every SGLang process runs;
`conn` holds the backend classes. Nothing here is imported by `transfer` itself, so the
messenger keeps working where SGLang is not installed.
"""

SGLANG_VERSION = "0.5.23"
BACKEND_NAME = "pdtool"
