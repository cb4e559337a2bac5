"""pdtool: declarative disaggregated prefill/decode serving for SGLang on Slurm."""

__version__ = "0.1.0"
