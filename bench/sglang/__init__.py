"""GPU benchmark suite for the SGLang dual-graph worker (run_sglang_suite.py)."""
