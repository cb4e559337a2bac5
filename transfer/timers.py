"""The transfer timers' defaults, in one place: the messenger's configs
(`transfer.messenger.common`), pdtool's config schema (`transfer.*` keys) and its plan read
these, so a default changed here changes what every one of them runs with.

- `TIMEOUT_S`: one transfer's limit, counted from when the prefill takes the request (SGLang's
  waiting timeout too, with engine=sglang).
- `CONNECT_TIMEOUT_S`: how long a decode rank waits for a prefill lead's control addresses at
  start (SGLang's bootstrap timeout, with engine=sglang).
- `PEER_TIMEOUT_S`: a messenger peer silent this long is dead (its lease ends one more period
  later); `HEARTBEAT_S`: how often the peers ping, which must be shorter.
"""

TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 120.0
PEER_TIMEOUT_S = 5.0
HEARTBEAT_S = 0.5
