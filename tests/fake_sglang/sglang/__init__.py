"""A stand-in for sglang in engine_child's process (tests/test_interleave.py): an Engine that
answers at once and appends each batch it serves to FAKE_SGLANG_LOG (the kind named by
FAKE_SGLANG_FAIL fails to start; FAKE_SGLANG_DIE=kind:n exits in that kind's n-th batch;
FAKE_SGLANG_SLOW_S makes every batch take that long, FAKE_SGLANG_OLD leaves out
Engine.freeze_gc), and a follower of the
bench's accept-length file that acknowledges each value as SGLang's scheduler would."""

import json
import os
import threading
import time


class Engine:
    def __init__(self, **kwargs):
        algo = kwargs.get("speculative_algorithm")
        self.kind = "plain" if algo is None else "eagle3" if algo == "EAGLE3" else "dual"
        if self.kind == os.environ.get("FAKE_SGLANG_FAIL"):
            raise RuntimeError(f"{self.kind}: out of memory (FAKE_SGLANG_FAIL)")
        self.kwargs = kwargs
        acc = os.environ.get("BENCH_ACC_FILE")
        if acc:
            threading.Thread(target=_acknowledge, args=(acc,), daemon=True).start()

    def generate(self, input_ids, sampling_params):
        self.batches = getattr(self, "batches", 0) + 1
        die = os.environ.get("FAKE_SGLANG_DIE", "")
        if die and die.split(":")[0] == self.kind and self.batches >= int(die.split(":")[1]):
            os._exit(9)
        time.sleep(float(os.environ.get("FAKE_SGLANG_SLOW_S", "0")))
        with open(os.environ["FAKE_SGLANG_LOG"], "a") as fh:
            fh.write(json.dumps({"kind": self.kind, "bs": len(input_ids),
                                 "tokens": sampling_params["max_new_tokens"],
                                 "kv": self.kwargs.get("max_total_tokens")}) + "\n")
        return [{"output_ids": [1] * sampling_params["max_new_tokens"]} for _ in input_ids]

    @property
    def freeze_gc(self):
        if os.environ.get("FAKE_SGLANG_OLD"):        # an SGLang from before Engine.freeze_gc
            raise AttributeError("freeze_gc")
        return self._freeze_gc

    def _freeze_gc(self):
        with open(os.environ["FAKE_SGLANG_LOG"], "a") as fh:
            fh.write(json.dumps({"kind": self.kind, "froze": True}) + "\n")

    def get_server_info(self):
        return {"internal_states": [{}]}

    def shutdown(self):
        pass


def _acknowledge(path):
    while True:
        try:
            with open(path) as fh:
                value = fh.read().strip()
            with open(f"{path}.ack-{os.getpid()}", "w") as fh:
                fh.write(value)
        except OSError:
            pass
        time.sleep(0.01)
