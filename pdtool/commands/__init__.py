"""One module per `pdtool` subcommand.

A command module defines `NAME`, `HELP`, `add_arguments(parser)` and `run(args) -> int`
(the exit code), and is registered by adding its module name to `pdtool.cli.COMMANDS`.
Keep module-level imports light (no torch/SGLang/libfabric): every command module is imported
to build the argument parser, and `pdtool validate` must start fast.
"""
