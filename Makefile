# diloco-async: the commands a newcomer needs. Each target does its own set-up.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
CONFIG ?= configs/default.toml

export PREFECT_HOME ?= $(CURDIR)/.local/prefect
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 120
export DO_NOT_TRACK ?= 1
export MLFLOW_DISABLE_TELEMETRY ?= true
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION ?= false
export GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT ?= false

.PHONY: setup data run test bench ui clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt constraints.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt -c constraints.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $@

data: setup
	@mkdir -p .local/prefect
	$(PY) -c "from diloco_async.data import ensure_shakespeare; print(ensure_shakespeare('data'))"

## run: the default job (4 learners, K = 1 with grace, Shakespeare) via the Prefect flow `train`
run: data
	$(VENV)/bin/diloco-async train --config $(CONFIG)

## test: the whole test suite
test: data
	$(PY) -m pytest -q

## bench: speed and memory benchmarks (ratios against baselines measured in the same run)
bench: data
	$(PY) -m benchmarks.run

## ui: MLflow UI (sqlite .local/mlflow.db, artifacts .local/mlartifacts) and the Prefect UI; Ctrl-C stops both
ui: setup
	@mkdir -p .local/prefect .local/mlartifacts
	@echo "MLflow UI:  http://127.0.0.1:5000"
	@echo "Prefect UI: http://127.0.0.1:4200  (runs of a train started with PREFECT_API_URL=http://127.0.0.1:4200/api)"
	@trap 'kill 0' INT TERM EXIT; \
	$(VENV)/bin/prefect server start --host 127.0.0.1 --port 4200 > .local/prefect-server.log 2>&1 & \
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(VENV)/bin/mlflow server --backend-store-uri sqlite:///$(CURDIR)/.local/mlflow.db \
	    --default-artifact-root $(CURDIR)/.local/mlartifacts --host 127.0.0.1 --port 5000 --workers 1

clean:
	rm -rf .local
