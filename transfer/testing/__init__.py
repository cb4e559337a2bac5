"""Test harnesses over the real parts (real processes, real libfabric), kept out of the
production packages: `loopback` runs prefill and decode messenger groups as processes on this
machine (used by the tests and bench/transfer.py).
"""
