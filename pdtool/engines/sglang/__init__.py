"""SGLang as pdtool runs it: what its processes need beyond the launch line (cpu.py)."""
