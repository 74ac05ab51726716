"""The ``mtpserve`` command (``mtpserve.cli``), started under jemalloc on Linux."""

from __future__ import annotations


def main() -> int:
    """The console command: re-executes itself under jemalloc (``engine.allocator``) before
    anything heavy is imported, then runs the command line."""
    from engine.allocator import reexec_under_jemalloc

    reexec_under_jemalloc()
    from mtpserve.cli import main as cli_main

    return cli_main()
