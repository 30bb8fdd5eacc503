# dual-graph-worker: the user's entry points. `make demo` (CPU) and `make test` set themselves up.
#
# Two interpreters, one rule each:
#   CPU targets run in .venv (made by `make setup`: CPU torch 2.13, the project, its test deps).
#   GPU targets run in GPU_PY, a Python that already has CUDA torch (and SGLang 0.5.17 for the
#   SGLang ones): `make bench GPU_PY=/path/to/python`. Every target writes under $(OUT).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
GPU_PY  ?= python3
OUT     ?= out
# CPU machines: the pinned CPU build of torch first, so `pip install -e .` never pulls a CUDA build.
TORCH_CPU ?= torch==2.13.0

.PHONY: help setup setup-test demo test settings toy capture-tune capture-report capture-flags \
        controller-cost host-cost host-cost-ab nsys-check test-gpu bench capture-measure capture-compare nsys-profile serve-bench policy-matrix \
        clean

help:                            ## this list
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t 18

$(BIN)/dgw: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_CPU)"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

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

setup: $(BIN)/dgw                ## CPU venv: torch 2.13 (CPU), the project, pytest

setup-test: $(VENV)/.sglang-cpu  ## setup + SGLang 0.5.17 without its GPU dependencies

# ---- CPU targets (run in .venv) --------------------------------------------------------------
demo: setup                      ## load ramp on a toy model: plain vs static spec vs the worker
	$(BIN)/dgw demo --out $(OUT)/demo

test: setup-test                 ## CPU test suite, SGLang plugin included (GPU tests skip)
	$(BIN)/python -m pytest -q -n auto

settings: setup                  ## every DGW_* setting; validates the current environment
	$(BIN)/dgw settings --check

toy: setup                       ## toy checkpoints with known acceptance -> $(OUT)/toy
	$(BIN)/dgw make-toy-checkpoints $(OUT)/toy

MEASUREMENTS ?= results/capture/measurements_h200_llama3-8b.json
MEMORY_BUDGET ?= 1GiB
TIME_BUDGET ?= 4
ACCEPT_LEN ?= 3.0
DISTRIBUTION ?= uniform:1-256
CAPTURE_CONFIG ?= $(OUT)/capture/config.json
# SPEC_MAX_BS caps the tuned spec pool (as the SGLang worker's DGW_SPEC_MAX_BS does its own):
# replays leave out a served step's host work and draft prefills, so they place the crossover high.
SPEC_MAX_BS ?=
capture-tune: setup              ## choose pool batch sizes under budgets -> $(CAPTURE_CONFIG)
	$(BIN)/dgw capture-tune --measurements $(MEASUREMENTS) --memory-budget $(MEMORY_BUDGET) \
	  --time-budget $(TIME_BUDGET) --distribution '$(DISTRIBUTION)' --accept-len $(ACCEPT_LEN) \
	  $(if $(SPEC_MAX_BS),--spec-max-bs $(SPEC_MAX_BS)) --out $(CAPTURE_CONFIG)

capture-report: setup            ## tables and plots of measurements + config -> $(OUT)/capture
	$(BIN)/dgw capture-report --measurements $(MEASUREMENTS) --config $(CAPTURE_CONFIG) \
	  --out-dir $(OUT)/capture/report

# e.g. FLAGS_ARGS="--model-path /models/llama --draft-model-path /models/eagle3": a complete line.
FLAGS_ARGS ?=
capture-flags: setup             ## SGLang flags + DGW_* env that run $(CAPTURE_CONFIG) on a server
	$(BIN)/dgw capture-flags $(CAPTURE_CONFIG) $(FLAGS_ARGS)

controller-cost: setup          ## host time of one controller decision -> $(OUT)/controller-cost.json
	$(BIN)/python -m bench.controller_cost --both --out $(OUT)/controller-cost.json

host-cost: setup-test           ## the SGLang worker's own host time per step -> $(OUT)/host-cost.json
	$(BIN)/python -m bench.sglang.host_cost --step-log --opcodes 300 --out $(OUT)/host-cost.json

BASE ?= HEAD
host-cost-ab: setup-test        ## this tree's per-step host time against BASE's, cold: make host-cost-ab BASE=ref
	rm -rf $(OUT)/base-tree && mkdir -p $(OUT)/base-tree && git archive $(BASE) | tar -x -C $(OUT)/base-tree
	$(BIN)/python -m bench.sglang.host_cost_ab $(OUT)/base-tree . --out $(OUT)/host-cost-ab

REPORT ?= $(OUT)/profile/workload.nsys-rep
nsys-check: setup                ## verdict on a profile: make nsys-check REPORT=path.nsys-rep
	$(BIN)/dgw check-profile $(REPORT) --out $(OUT)/profile-check

# ---- GPU targets (run in $(GPU_PY): CUDA torch; SGLang 0.5.17 for serve-bench/policy-matrix)
test-gpu:                        ## GPU: the GPU tests only
	$(GPU_PY) -m pytest -q -m gpu tests/test_gpu.py

bench:                           ## GPU: reference worker variants across concurrency -> $(OUT)/bench
	$(GPU_PY) -m bench.reference.bench --accept-len 3 --repeats 2 --out $(OUT)/bench

# ENGINE=sglang: the SGLang worker in an SGLang 0.5.17 engine (capture-measure, nsys-profile)
ENGINE ?= reference
capture-measure:                 ## GPU: capture time, memory, step latency of every candidate graph
ifeq ($(ENGINE),sglang)
	$(GPU_PY) -m bench.sglang.capture_measure --out $(OUT)/capture-sglang
else
	$(GPU_PY) -m capture.measure --out $(OUT)/capture/measurements.json
endif

# served: the batch sizes the default server ran over the workload (its step log).
COMPARE_DISTRIBUTION ?= served
capture-compare:                 ## GPU: tuned config vs default lists on SGLang -> $(OUT)/capture-compare
	$(GPU_PY) -m bench.sglang.capture_compare --out $(OUT)/capture-compare \
	  --measurements $(MEASUREMENTS) --memory-budget $(MEMORY_BUDGET) --accept-len $(ACCEPT_LEN) \
	  --distribution '$(COMPARE_DISTRIBUTION)' $(if $(SPEC_MAX_BS),--spec-max-bs $(SPEC_MAX_BS))

PROFILE_MODEL ?= llama3-8b
EXPECT_SM ?=
nsys-profile:                    ## GPU: nsys profile of the scripted workload + its check -> $(OUT)/profile
ifeq ($(ENGINE),sglang)
	$(GPU_PY) -m bench.sglang.profile_workload --nsys --out $(OUT)/profile-sglang $(if $(EXPECT_SM),--expect-sm $(EXPECT_SM))
else
	$(GPU_PY) -m dual_graph_worker.cli profile --model $(PROFILE_MODEL) --out $(OUT)/profile $(if $(EXPECT_SM),--expect-sm $(EXPECT_SM))
endif

# e.g. SERVE_ARGS="--soak 10000" (the worker under random lengths, aborts, retraction, a
# switching policy; T=0 answers checked against plain's).
SERVE_ARGS ?=
serve-bench:                     ## GPU: HTTP servers (plain, EAGLE-3, worker) under bench_serving -> $(OUT)/serve-bench
	$(GPU_PY) -m bench.sglang.serve_bench --out $(OUT)/serve-bench $(SERVE_ARGS)

# e.g. MATRIX_ARGS="--radix-cache --step-log" (the worker's per-step costs, step-costs.md).
MATRIX_ARGS ?= --radix-cache
policy-matrix:                   ## GPU: accept lengths x workloads x concurrency -> $(OUT)/policy-matrix
	$(GPU_PY) -m bench.sglang.policy_matrix --out $(OUT)/policy-matrix $(MATRIX_ARGS)

clean:                          ## remove $(OUT) and .pytest_cache
	rm -rf $(OUT) .pytest_cache
