"""Launchers: the launch spec (processes and command lines), Slurm submission, local supervisor."""
