# dual-graph-worker: the user's entry points. `make setup` once, then `make demo` / `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
OUT     ?= out
# CPU machines: the pinned CPU build of torch first, so `pip install -e .` never pulls a CUDA build.
TORCH_CPU ?= torch==2.13.0

.PHONY: setup setup-test demo test test-gpu bench capture-measure capture-tune capture-report capture-flags nsys-profile nsys-check toy clean

$(BIN)/dgw:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_CPU)"
	$(BIN)/pip install -q -e ".[test]"

# Real SGLang 0.5.17 on the CPU, so its plugin tests run: its own wheel without dependencies
# (they pin torch 2.11 with CUDA), then the light packages its imports need (extra sglang-cpu).
# torchvision's release for torch 2.13 is a CUDA build whose fake-kernel registration fails
# without its C++ ops (pytorch/vision#9337); the sed applies the upstream fix (vision#9649).
$(VENV)/.sglang-cpu: $(BIN)/dgw pyproject.toml
	$(BIN)/pip install -q --no-deps torchvision==0.28.0 triton==3.6.0
	$(BIN)/pip install -q "$(TORCH_CPU)" -e ".[test,sglang-cpu]" 2>&1 | grep -v "sglang 0.5.17 requires" || true
	$(BIN)/pip install -q --no-deps sglang==0.5.17
	sed -i 's/^@torch.library.register_fake("torchvision::\(q\?nms\)")$$/@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda fn: fn))/' \
	  "$$($(BIN)/python -c 'import importlib.util as u; print(u.find_spec("torchvision").submodule_search_locations[0])')/_meta_registrations.py"
	$(BIN)/python -c "import sglang.srt.speculative.eagle_worker_v2, torch; assert torch.__version__.endswith('+cpu')"
	touch $@

setup: $(BIN)/dgw

setup-test: $(VENV)/.sglang-cpu

demo: setup                      ## load ramp, plain vs static spec vs dynamic (CPU by default)
	$(BIN)/dgw demo --out $(OUT)/demo

test: setup-test                 ## CPU test suite, SGLang plugin included (GPU tests skip)
	$(BIN)/python -m pytest -q

test-gpu:                        ## GPU tests only (on a CUDA machine, with the system torch)
	$(PY) -m pytest -q -m gpu tests/test_gpu.py

bench:                           ## GPU: every worker variant across concurrency -> results/reference
	$(PY) -m dual_graph_worker.engines.reference.bench --accept-len 3 --repeats 2 --out results/reference
	$(PY) -m dual_graph_worker.engines.reference.bench --accept-len 2 --variants plain,static-spec,dynamic --skip-memory --skip-switch --out results/reference

capture-measure:                 ## GPU: capture time, memory, step latency of every candidate graph
	$(PY) -m capture.measure --out results/capture/measurements.json

MEASUREMENTS ?= results/capture/measurements_h200_llama3-8b.json
MEMORY_BUDGET ?= 1GiB
TIME_BUDGET ?= 4
ACCEPT_LEN ?= 3.0
DISTRIBUTION ?= uniform:1-256
capture-tune:                    ## choose pool batch sizes under budgets -> capture/config.json
	$(PY) -m capture.cli tune --measurements $(MEASUREMENTS) --memory-budget $(MEMORY_BUDGET) \
	  --time-budget $(TIME_BUDGET) --distribution $(DISTRIBUTION) --accept-len $(ACCEPT_LEN) --out capture/config.json

capture-report:                  ## tables and plots of the measurements and the chosen config
	$(PY) -m capture.cli report --measurements $(MEASUREMENTS) --config capture/config.json --out-dir $(OUT)/capture-report

CAPTURE_CONFIG ?= capture/config.json
capture-flags:                   ## SGLang flags + DGW_* env that run a capture config on a server
	$(PY) -m dual_graph_worker.engines.sglang.capture_config $(CAPTURE_CONFIG)

PROFILE_MODEL ?= llama3-8b
# ENGINE=sglang: the SGLang worker in an SGLang 0.5.17 engine (GPU, nsys) -> $(OUT)/profile-sglang
ENGINE ?= reference
EXPECT_SM ?=
nsys-profile:                    ## nsys profile of the scripted workload + its check -> $(OUT)/profile
ifeq ($(ENGINE),sglang)
	$(PY) -m bench.sglang.profile_workload --nsys --out $(OUT)/profile-sglang $(if $(EXPECT_SM),--expect-sm $(EXPECT_SM))
else
	$(PY) -m dual_graph_worker.cli profile --model $(PROFILE_MODEL) --out $(OUT)/profile $(if $(EXPECT_SM),--expect-sm $(EXPECT_SM))
endif

REPORT ?= $(OUT)/profile/workload.nsys-rep
nsys-check:                      ## check an existing report: make nsys-check REPORT=path.nsys-rep
	$(PY) -m profiling.check $(REPORT) --out $(OUT)/profile-check

toy:                             ## toy checkpoints with known acceptance -> $(OUT)/toy
	$(BIN)/dgw make-toy-checkpoints $(OUT)/toy

clean:
	rm -rf $(OUT) .pytest_cache
