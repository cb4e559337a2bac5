"""What both halves of the SGLang backend's manager raise, and the size they share."""

from __future__ import annotations

#: concurrent transfers per rank: the decode's slots, the prefill's completion tags
MAX_SLOTS = 4096


class PdtoolBackendError(RuntimeError):
    """A deployment this backend cannot serve; the message names the setting to change."""
