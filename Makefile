# diloco-async: the commands a newcomer needs. Each target does its own set-up.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
CONFIG ?= configs/default.toml
# make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu: torch 2.13.0 from that index first (PyPI's
# Linux torch is the CUDA build, several GB); empty: pip's own indexes (this machine's carry the CPU wheel)
TORCH_INDEX ?=

export PREFECT_HOME ?= $(CURDIR)/.local/prefect
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 120
export DO_NOT_TRACK ?= 1
export MLFLOW_DISABLE_TELEMETRY ?= true
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION ?= false
export GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT ?= false

# make ui / make ui-screenshot: the tracking database `make run` logs to (tracking.mlflow_uri) and the
# artifact root of experiments created in the UI (runs keep the artifact location they recorded)
MLFLOW_DB        ?= .local/mlflow.db
MLFLOW_ARTIFACTS ?= .local/store/mlartifacts
MLFLOW_PORT      ?= 5000
PREFECT_PORT     ?= 4200
MLFLOW_ARTIFACTS_URI = $(if $(findstring ://,$(MLFLOW_ARTIFACTS)),$(MLFLOW_ARTIFACTS),file://$(abspath $(MLFLOW_ARTIFACTS)))

# waits until every URL answers (180 s at most)
define WAIT_HTTP
import sys, time, urllib.request
deadline = time.time() + 180
for url in sys.argv[1:]:
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).read(); break
        except Exception:
            if time.time() > deadline: sys.exit(f"no answer from {url}; see .local/*-server.log")
            time.sleep(0.5)
endef
export WAIT_HTTP

.PHONY: setup data run docs test test-unit test-contract test-system bench bench-paper bench-memory-big bench-hf bench-fsdp bench-lora bench-poison bench-end bench-chaos bench-exactly-once bench-het bench-wan bench-sync-memory bench-fuzz bench-kill bench-tls bench-leases bench-data bench-scale bench-scale-runs bench-replay rehearse-hosts ui ui-screenshot mlflow-check clean gpu-check

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt constraints.txt pyproject.toml
	@$(PYTHON) -c "import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else \
		'make setup needs Python 3.11 (constraints.txt is the freeze of a 3.11 environment; docs/install.md); $(PYTHON) is %d.%d: run make PYTHON=python3.11' \
		% sys.version_info[:2])"
	$(PYTHON) -m venv $(VENV)
	$(if $(TORCH_INDEX),$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0 --index-url $(TORCH_INDEX))
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt -c constraints.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $@

data: setup
	@mkdir -p .local/prefect
	$(PY) -c "from diloco_async.data.sources import ensure_shakespeare; print(ensure_shakespeare('data'))"

## run: the default job (4 learners, K = 1 with grace, Shakespeare) via the Prefect flow `train`
run: data
	$(VENV)/bin/diloco-async train --config $(CONFIG)

## gpu-check: on a machine with CUDA, a few minutes (GPU_CHECK_S) of the GPU recipe on cuda in bf16
##            (NPROC ranks per learner), then tokens/s and eval loss (scripts/gpu_check.sh)
gpu-check: data
	PY=$(PY) scripts/gpu_check.sh

## test: lint (ruff, pyproject.toml [tool.ruff]), the import contracts (lint-imports, pyproject.toml
##       [tool.importlinter]: layers, no import cycle), the strict docs build, then every tier of the suite in one pytest session of
##       TEST_WORKERS processes (pytest-xdist, as many as cores), unit tests first: tests/unit (no
##       process, socket or real sleep), tests/contract (in-process servers, moto S3, the GCS emulator),
##       tests/system (real processes, Prefect, MLflow). It prints each skip with its reason, the 15
##       slowest tests, each tier's test seconds and the wall time (docs/testing.md; about 10 minutes
##       on 2 cores). One session, not one
##       per tier: the workers start once and the tiers' tails overlap; the longest system modules
##       start first. TIERS="unit contract" runs some tiers only.
## test-unit: the unit tier alone (about a minute), for the edit loop; test-contract, test-system likewise
TEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 2)
TIERS ?= unit contract system
PYTEST_TIER = $(PY) -m pytest -q -rs -n $(TEST_WORKERS) --dist loadgroup --durations=15
test: data
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache
	$(MKDOCS_BUILD)
	@start=$$(date +%s); $(PYTEST_TIER) $(addprefix tests/,$(TIERS)); rc=$$?; \
	echo "== make test: tiers $(TIERS) in $$(( $$(date +%s) - start )) s"; exit $$rc

test-unit test-contract test-system: test-%: data
	$(PYTEST_TIER) tests/$*

## docs: the docs site (mkdocs.yml, the built-in theme) into SITE_DIR, --strict: a broken link or anchor,
##       or a page missing from the nav, fails it; the config reference, module map and current figures
##       are generated as it builds (scripts/docs_hooks.py; docs/testing.md "The docs site"). A few seconds.
SITE_DIR ?= .local/site
# not --quiet: mkdocs 1.6.1 then drops the warnings before --strict counts them, and passes a broken link
MKDOCS_BUILD = $(VENV)/bin/mkdocs build --strict --site-dir $(SITE_DIR)
docs: setup
	$(MKDOCS_BUILD)

## bench: speed and memory benchmarks, ratios against baselines measured in the same run: bench-hf (an HF
##        learner inside a run against a plain loop), then issue 17's goals (benchmarks/run.py: merge, codecs
##        and file:// store, S3 store, 256 and 1,000 learners on one synchronizer, learner and synchronizer
##        RSS, a 100M-parameter run with 2 learners, learner tokens/s at ~50M), ending with one bars table;
##        exit 1 on any miss. About 25 minutes, 7 GB free memory. BENCH_ONLY=merge,sync_load runs some sections of benchmarks/run.py only.
BENCH_ONLY ?=
# every bars table is also merged into docs/figures.json (benchmarks/bars.py; the docs' "Current figures")
bench: export BENCH_RESULTS ?= $(CURDIR)/docs/figures.json
bench: data
	HF_HUB_OFFLINE=1 $(PY) -m benchmarks.hf_learner; hf=$$?; \
	$(PY) -m benchmarks.run $(if $(BENCH_ONLY),--only $(BENCH_ONLY)); run=$$?; \
	exit $$(( hf != 0 || run != 0 ))

## bench-memory-big: a 100M-parameter run with 2 learners (a few outer rounds) completes on this machine;
## its RSS bars and how long it took (benchmarks/memory.py --big)
bench-memory-big: data
	$(PY) -m benchmarks.memory --sizes none --big

## bench-poison: make run's recipe with three honest learners, then with a fourth that sends poisoned
## outer gradients (x1e6, sign flip, constant), each to the same global step; bars: held-out loss
## within 2% of the honest run's, nothing huge or non-finite published (benchmarks/poison.py).
## About 4 runs of 2-4 minutes.
bench-poison: data
	$(PY) -m benchmarks.poison --config $(CONFIG) --out $(BENCH_DIR)/poison.json

## bench-end: the end of a run (issue 44; docs/end-of-run.md): make run's recipe once per END_SEEDS (run.seed),
## one after the other, with make run's held-out monitor beside it; per seed the final model's loss minus the
## best periodic eval; bar: the upper end of its 95% t-interval <= 0.01 nats/token (benchmarks/end_of_run.py).
## Free-running, not replayed. END_SET="--set budget.wall_s=240" shortens each run; about 5 runs of 5-9 minutes.
END_SEEDS ?= 0,1,2,3,4
END_SET ?=
bench-end: data
	$(PY) -m benchmarks.end_of_run --config $(CONFIG) --seeds $(END_SEEDS) $(END_SET) --out $(BENCH_DIR)/end_of_run.json

## bench-lora: a LoRA fine-tune of a small pretrained Llama through the system, 3 seeds of 240k tokens
##             (benchmarks/lora_quality.py): its held-out loss below the base's, mean over seeds > 0
##             (tests/system/test_models_system.py checks only that the adapter alone moved). About 3-10 minutes.
bench-lora: data
	HF_HUB_OFFLINE=1 $(PY) -m benchmarks.lora_quality --out $(BENCH_DIR)/lora_quality.json

## bench-fsdp: learner groups sharded with FSDP2, 2 ranks (benchmarks/fsdp_bars.py): per-rank peak RSS beyond the
##             interpreter + torch baseline at >= 200M parameters <= 6 x model fp32 / N + largest fragment / N, and
##             an FSDP2 learner's tokens/s in a run against the same group in a plain loop >= 0.95. About 8 minutes,
##             6 GB free memory and 8 GB of disk.
bench-fsdp: data
	$(PY) -m benchmarks.fsdp_bars

## bench-hf: tokens/s of one learner running configs/hf-llama-cpu.toml inside a run (synchronizer + 1 learner)
##           against the same model in a plain torch loop with the same batch, measured in the same run:
##           >= 0.95 (benchmarks/hf_learner.py). About 2.5 minutes.
bench-hf: data
	HF_HUB_OFFLINE=1 $(PY) -m benchmarks.hf_learner

## bench-paper: the paper's ablations (configs/ablations/*.toml except ci.toml: merge, heterogeneity,
##              precision, fragmentation, adoption, outer-optimizer; and schedules), 3 seeds per arm, each (arm, seed) a
##              real run; a table per suite (paper, our mean ± 95% interval, paired difference, verdict),
##              then every suite's table from $(ABLATE_DIR)/<suite>/report.md. Resumable: finished runs
##              are kept there and not re-run. About 60-90 minutes on 2 cores; exit 1 if a suite failed.
ABLATE_DIR ?= .local/ablate
ABLATE_SUITES ?= merge heterogeneity precision fragmentation adoption outer-optimizer schedules error-feedback muon
bench-paper: data
	@failed=""; for s in $(ABLATE_SUITES); do \
	  $(VENV)/bin/diloco-async ablate --suite configs/ablations/$$s.toml --out $(ABLATE_DIR)/$$s || failed="$$failed $$s"; \
	done; \
	for s in $(ABLATE_SUITES); do \
	  [ -f $(ABLATE_DIR)/$$s/report.md ] && { echo; echo "## $$s"; sed -n '/^| comparison/,/^$$/p' $(ABLATE_DIR)/$$s/report.md; }; \
	done; \
	if [ -n "$$failed" ]; then echo "bench-paper: failed suites:$$failed" >&2; exit 1; fi

## bench-chaos: the full "storm" scenario (8 slots, a failure per slot every 120 s, 30 s down, one
## slot at half speed): DDP, synchronous and Decoupled DiLoCo, 5 minutes each; then failure-free
## (5 minutes each) and one half-speed learner (K = M against K = 1, 90 s each); then the
## heterogeneous fleet (bench-het's runs, about 15 minutes); then the bars as ratios
## (benchmarks/chaos_bars.py, benchmarks/het_bars.py); then bench-exactly-once's row (exit 1 if any misses).
## About 60 minutes.
## bench-het: the heterogeneous fleet alone (issue 47, configs/chaos/heterogeneous.toml: learners at 1x,
## 0.5x and 0.1x speed, one with 3 s store reads, one behind a 4 Mbit/s link, shaped as root, else skipped),
## Decoupled DiLoCo 90 s per run, for each of HET_SEEDS the scenario then its --full-speed baseline; then
## the speed factors' control without a synchronizer (benchmarks/speed_emulation.py, shown, ~2 min) and
## the bars (benchmarks/het_bars.py): every learner's merged share of the tokens >= 0.8 x the share of
## the compute it had, compute goodput in compute available >= 0.9 x the full-speed fleet's. About 17 minutes.
## bench-exactly-once: leased slices under EXACTLY_ONCE_KILLS (default 20) learner SIGKILLs, some mid-upload,
##                     on a corpus of EXACTLY_ONCE_SLICES (256) slices with a budget of EXACTLY_ONCE_EPOCHS (3)
##                     corpora, learners at speed 0.03 (benchmarks/exactly_once.py, issue 45): no slice trained twice in an epoch, none
##                     lost, the summary agrees with the merge log, >= 1 kill confirmed mid-upload, >= 1 epoch
##                     with every slice trained in it. A few minutes.
BENCH_DIR ?= .local/bench
EXACTLY_ONCE_KILLS ?= 20
EXACTLY_ONCE_SLICES ?= 256
EXACTLY_ONCE_EPOCHS ?= 3
EXACTLY_ONCE = $(PY) -m benchmarks.exactly_once --learner-kills $(EXACTLY_ONCE_KILLS) --slices $(EXACTLY_ONCE_SLICES) \
	--epochs $(EXACTLY_ONCE_EPOCHS)
HET_SEEDS ?= 0 1 2
HET_CHAOS := $(VENV)/bin/diloco-async chaos --scenario configs/chaos/heterogeneous.toml
HET_RUNS = for s in $(HET_SEEDS); do \
	  $(HET_CHAOS) --set run.seed=$$s --out $(BENCH_DIR)/chaos-het-$$s.json || exit 1; \
	  $(HET_CHAOS) --set run.seed=$$s --full-speed --out $(BENCH_DIR)/chaos-het-full-$$s.json || exit 1; \
	done
HET_BARS = $(PY) -m benchmarks.speed_emulation --run-s 30 --repeats 3 && $(PY) -m benchmarks.het_bars --het $(HET_SEEDS:%=$(BENCH_DIR)/chaos-het-%.json) \
	--full $(HET_SEEDS:%=$(BENCH_DIR)/chaos-het-full-%.json)
bench-chaos: data
	$(VENV)/bin/diloco-async chaos --scenario configs/chaos/storm.toml --out $(BENCH_DIR)/chaos-storm.json
	$(VENV)/bin/diloco-async chaos --scenario configs/chaos/failure-free.toml --out $(BENCH_DIR)/chaos-failure-free.json
	$(VENV)/bin/diloco-async chaos --scenario configs/chaos/straggler.toml --out $(BENCH_DIR)/chaos-straggler.json
	$(HET_RUNS)
	status=0; $(PY) -m benchmarks.chaos_bars $(BENCH_DIR)/chaos-storm.json $(BENCH_DIR)/chaos-failure-free.json \
		$(BENCH_DIR)/chaos-straggler.json || status=1; $(HET_BARS) || status=1; $(EXACTLY_ONCE) || status=1; exit $$status

bench-exactly-once: data
	$(EXACTLY_ONCE)

bench-het: data
	$(HET_RUNS)
	$(HET_BARS)

## rehearse-hosts: a multi-host rehearsal on this machine (needs root: network and mount namespaces;
##                 refuses with the reason otherwise). Two learner hosts and the synchronizer's host, each
##                 with its own disk, checkout and Prefect worker; S3 (moto), Prefect and MLflow in a hub.
##                 `train` on both hosts, `resume` from S3 on the other host, every recorded path opened
##                 from the other host (docs/multi-host.md). A few minutes; result in .local/rehearse-hosts/.
rehearse-hosts: data
	$(PY) -m diloco_async.flows.rehearsal

## bench-wan: issue 13 over emulated regions (needs root and iproute2 tc): configs/wan/wan-4-regions.toml,
## DDP, synchronous and Decoupled DiLoCo over four 7.5 Mbit/s links (DDP capped at 300 s); Decoupled DiLoCo
## again with seeds 1 and 2, then with bf16 uploads and fp32 downloads (seeds 0-2); then tokens/s shaped against
## unshaped (benchmarks/wan_tokens.py: 400K-token Decoupled runs, shaped and on loopback interleaved ABBA, 2 pairs,
## steady-state tokens/s); then the bars (benchmarks/wan_bars.py): time to DDP's final loss, bytes per token,
## loss at equal tokens, tokens/s shaped / unshaped. About 30 minutes on 2 quiet cores.
WAN_SCENARIO ?= configs/wan/wan-4-regions.toml
WAN_BASELINE ?= --set learners.codec=bf16 --set synchronizer.download_codec=fp32
WAN := $(PY) -m diloco_async.flows.cli wan --scenario $(WAN_SCENARIO)
bench-wan: data
	$(WAN) --out $(BENCH_DIR)/wan-main.json
	for s in 1 2; do $(WAN) --methods decoupled --seed $$s --out $(BENCH_DIR)/wan-compressed-$$s.json || exit 1; done
	for s in 0 1 2; do $(WAN) --methods decoupled --seed $$s $(WAN_BASELINE) \
		--out $(BENCH_DIR)/wan-bf16-fp32-$$s.json || exit 1; done
	$(PY) -m benchmarks.wan_tokens --scenario $(WAN_SCENARIO) --pairs 2 --tokens 400000 --seed 0 \
		--out $(BENCH_DIR)/wan-tokens.json
	$(PY) -m benchmarks.wan_bars $(BENCH_DIR)/wan-main.json \
		--compressed $(BENCH_DIR)/wan-main.json $(BENCH_DIR)/wan-compressed-1.json $(BENCH_DIR)/wan-compressed-2.json \
		--baseline $(BENCH_DIR)/wan-bf16-fp32-0.json $(BENCH_DIR)/wan-bf16-fp32-1.json \
		$(BENCH_DIR)/wan-bf16-fp32-2.json --tokens-ab $(BENCH_DIR)/wan-tokens.json

## bench-sync-memory: a real run with 4 learners for MINUTES (default 20); the synchronizer's RSS at
## minute 5 and at the end must stay within 10% (benchmarks/sync_memory.py)
MINUTES ?= 20
bench-sync-memory: data
	$(PY) -m benchmarks.sync_memory --minutes $(MINUTES)

## bench-data: the token store (issue 45; docs/data-and-models.md "The token store"): tokenization throughput
##             with 2 workers over 1 (BPE 4096, a 96 MiB synthetic JSONL corpus, 2 interleaved pairs) >= 1.7, and
##             the peak RSS of tokenizing a 5 GiB corpus within 10% of a 0.5 GiB one, and of a learner training
##             leased slices of each for 60 s (benchmarks/data_bars.py; corpora from benchmarks/synth_corpus.py,
##             generated under DATA_BENCH_DIR and deleted; ~17 GB free disk).
DATA_BENCH_DIR ?= /tmp
bench-data: setup
	$(PY) -m benchmarks.data_bars --dir $(DATA_BENCH_DIR)

## bench-scale: synchronizer shards (issue 40; DESIGN §2.2): merged contribution bytes per second with two
##              synchronizer processes over one, under a merge-bound load of scripted learners speaking the
##              real protocol (benchmarks/scale.py), SCALE_REPEATS (3) interleaved pairs of 30 s on the same cores;
##              bar: >= 1.6 (one pair with a core per shard shown beside it)
SCALE_REPEATS ?= 3
bench-scale: setup
	$(PY) -m benchmarks.scale --repeats $(SCALE_REPEATS)

## bench-scale-runs: make run's recipe end to end with real learners on two synchronizer shards against one,
##                   per SCALE_SEEDS (run.seed); bars: final loss S = 2 / S = 1 within 2%, compute goodput within
##                   0.05, each |mean| + 95% half-width (benchmarks/scale_runs.py). About 6 runs of 3 minutes.
SCALE_SEEDS ?= 0,1,2
bench-scale-runs: data
	$(PY) -m benchmarks.scale_runs --config $(CONFIG) --seeds $(SCALE_SEEDS)

## bench-leases: a learner's tokens/s on leased slices (data.slices, DESIGN §5.2) against its fixed shard, LEASE_PAIRS
##               (default 3) interleaved pairs of LEASE_RUN_S (60) seconds each; bar: leases / shards >= 0.98
LEASE_PAIRS ?= 3
LEASE_RUN_S ?= 60
bench-leases: data
	$(PY) -m benchmarks.lease_tokens --pairs $(LEASE_PAIRS) --run-s $(LEASE_RUN_S)

## bench-tls: a learner's tokens/s in a run with mutual TLS against the same run in direct mode, TLS_PAIRS
##            (default 3) interleaved pairs of TLS_RUN_S (60) seconds each; bar: tls / direct >= 0.98
TLS_PAIRS ?= 3
TLS_RUN_S ?= 60
bench-tls: data
	$(PY) -m benchmarks.tls_tokens --pairs $(TLS_PAIRS) --run-s $(TLS_RUN_S)

## bench-replay: what run.schedule = "replay" costs (docs/replay.md): REPLAY_SEEDS (default 3) seeds of a tiny
##               recipe, each free, replayed, and replayed again beside a CPU hog; bar: the replays of a seed
##               publish the same versions; replay / free wall seconds shown
REPLAY_SEEDS ?= 3
bench-replay: data
	$(PY) -m benchmarks.replay_cost --seeds $(REPLAY_SEEDS)

## bench-fuzz: FUZZ_REQUESTS (default 10,000) seeded valid, boundary and hostile requests on every route of a
## live synchronizer, honest scripted learners merging meanwhile: zero 5xx, alive, merging, RSS growth < 10%
## (benchmarks/fuzz.py; about a minute)
FUZZ_REQUESTS ?= 10000
bench-fuzz: data
	$(PY) -m benchmarks.fuzz --requests $(FUZZ_REQUESTS)

## bench-kill: the kill matrix (benchmarks/kill_matrix.py): LEARNER_KILLS (default 50) SIGKILLs of real
## learners at random moments, some mid-upload, and SYNC_KILLS (default 20) SIGKILL + resume cycles of the
## synchronizer: every resume finishes, merges resume within 30 s, no partial object merged, nothing
## non-finite published; then CTRL_C_REPEATS (default 5) Ctrl-C stops typed into a real terminal on
## train, resume and status --watch (benchmarks/ctrl_c.py): the median to the prompt <= 10 s each, every
## stop exit 130 without a traceback (tests/system/test_stop.py checks what a stop leaves, not its speed)
LEARNER_KILLS ?= 50
SYNC_KILLS ?= 20
CTRL_C_REPEATS ?= 5
bench-kill: data
	$(PY) -m benchmarks.kill_matrix --learner-kills $(LEARNER_KILLS) --sync-kills $(SYNC_KILLS) \
	  --ctrl-c-repeats $(CTRL_C_REPEATS)

## ui: MLflow tracking server (sqlite $(MLFLOW_DB), artifacts in the store: $(MLFLOW_ARTIFACTS)) and the
##     Prefect server (database in $(PREFECT_HOME)); prints both addresses; Ctrl-C stops both. The Prefect
##     UI asks the API at PREFECT_SERVER_API_PORT's port (`--port` alone leaves its page asking 4200)
ui: setup
	@mkdir -p $(PREFECT_HOME) $(dir $(MLFLOW_DB)) $(if $(findstring ://,$(MLFLOW_ARTIFACTS)),,$(MLFLOW_ARTIFACTS))
	@trap 'trap - INT TERM EXIT; kill 0' INT TERM EXIT; \
	PREFECT_SERVER_API_PORT=$(PREFECT_PORT) $(VENV)/bin/prefect server start --host 127.0.0.1 --port $(PREFECT_PORT) \
	    > .local/prefect-server.log 2>&1 & \
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(VENV)/bin/mlflow server \
	    --backend-store-uri sqlite:///$(abspath $(MLFLOW_DB)) \
	    --default-artifact-root $(MLFLOW_ARTIFACTS_URI) --artifacts-destination $(MLFLOW_ARTIFACTS_URI) \
	    --host 127.0.0.1 --port $(MLFLOW_PORT) --workers 1 > .local/mlflow-server.log 2>&1 & \
	$(PY) -c "$$WAIT_HTTP" http://127.0.0.1:$(MLFLOW_PORT)/health http://127.0.0.1:$(PREFECT_PORT)/api/health || exit 1; \
	echo "MLflow UI:  http://127.0.0.1:$(MLFLOW_PORT)  (experiment diloco-async; sqlite $(MLFLOW_DB), artifacts $(MLFLOW_ARTIFACTS); log .local/mlflow-server.log)"; \
	echo "Prefect UI: http://127.0.0.1:$(PREFECT_PORT)  (flow runs of make run; log .local/prefect-server.log)"; \
	echo "Ctrl-C stops both."; \
	wait

## ui-screenshot: headless Chromium screenshots of the newest run's page and its metric charts, in
##     .local/screenshots (MLFLOW_URL=http://127.0.0.1:5000 to use a running `make ui`; RUN_ID=... for one run)
ui-screenshot: setup
	$(PY) scripts/mlflow_screenshot.py --out .local/screenshots --pages overview,model-metrics,system-metrics,learners,runs --expect eval/loss --expect goodput/compute \
	    $(if $(MLFLOW_URL),--url $(MLFLOW_URL),--db $(MLFLOW_DB) --artifact-root $(MLFLOW_ARTIFACTS)) \
	    $(if $(RUN_ID),--run-id $(RUN_ID))

## mlflow-check: read the newest training run back from $(MLFLOW_DB) with MlflowClient and print its
##     dashboard: eval/loss and goodput points, system metrics, the model-training marker (RUN_ID=... for one run)
mlflow-check: setup
	$(PY) scripts/mlflow_readback.py --db $(MLFLOW_DB) $(if $(RUN_ID),--run-id $(RUN_ID))

clean:
	rm -rf .local
