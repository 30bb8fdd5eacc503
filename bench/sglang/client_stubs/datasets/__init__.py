"""Stand-in for Hugging Face `datasets`, put on bench_serving's path by serve_bench only where
the real package is missing (the H200 image lacks it): bench_serving imports it at start-up for
its hub datasets, which serve-bench's random-ids never loads."""


def load_dataset(*args, **kwargs):
    raise ImportError("Hugging Face `datasets` is not installed: serve-bench's random-ids needs "
                      "none, bench_serving's hub datasets do (pip install datasets)")
