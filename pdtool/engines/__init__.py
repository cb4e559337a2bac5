"""Serving engines pdtool can start itself (the reference CPU engine); SGLang is external."""
