"""The engine-neutral parts of the KV data plane that both control planes share.

`transfer.messenger` (the reference engine's messenger) and `transfer.sglang` (SGLang's
backend) decide what to send and when; what they both keep the same way lives here and imports
only `transfer.fabric`: the prefill send ledger (`ledger`), the decoder's transfer slots and
their counts (`slots`), the shm stall rule (`stall`), and the names of the transfer metrics
both export (`metrics`).
"""
