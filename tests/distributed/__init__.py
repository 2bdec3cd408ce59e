"""Multi-process tests: Gloo on CPU, launched with ``tests.distributed._launch.run_distributed``."""
