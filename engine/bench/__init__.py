"""Benchmarks: ``mtpserve bench``, ``bench-chat``, ``bench-batch`` and the memory probe."""
