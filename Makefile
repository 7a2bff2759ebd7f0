SHELL := /bin/bash
.DEFAULT_GOAL := help
CACHE ?= $(or $(FSDP_CACHE_DIR),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/fsdp-operator)
VENV ?= $(or $(FSDP_VENV),$(CACHE)/venv)
PY := $(VENV)/bin/python
# The DLC's environment (Python 3.13, hack/dlc/requirements.lock): the trainer's own tests run where the
# trainer runs in production, the rest in the operator's.
DLC_VENV ?= $(or $(FSDP_DLC_VENV),$(CACHE)/dlc-venv)
DLC_PY := $(DLC_VENV)/bin/python
TRAINER_TESTS := tests/trainer
PYTEST_ARGS ?=
# pytest workers of `make test`, each with a local cluster of its own (hack/lib.sh FSDP_CLUSTER_INSTANCE).
TEST_WORKERS ?= 2
# Prerequisites are built side by side: each pip and each Go link is single-threaded, so on a fresh machine
# the installs, the Go builds and the image builds overlap. Recipes still run in order within a target.
MAKEFLAGS += --jobs=4
# What the local cluster runs, built side by side (a cold start's slow parts: the Go tools and the DLC stand-in).
LOCAL_CLUSTER_PREREQUISITES := venv-operator venv-dlc cluster-tools dlc-image
# The demo on the cluster KUBECONFIG names (not the local one, whose kubeconfig is in .local-cluster/) needs only
# the operator's environment.
DEMO_PREREQUISITES := $(if $(filter-out $(CURDIR)/.local-cluster/kubeconfig,$(KUBECONFIG)),venv-operator,$(LOCAL_CLUSTER_PREREQUISITES))

.PHONY: help
help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-15s %s\n", $$1, $$2}'

.PHONY: venv venv-operator venv-dlc venv-mlflow
venv: venv-operator venv-dlc venv-mlflow ## create/update the three Python virtualenvs from their locks (outside the repo)
venv-operator venv-dlc venv-mlflow:
	@hack/venv.sh $(@:venv-%=%)

.PHONY: packages
packages: ## the Debian packages the tools, images and tests need (a no-op when all are there)
	@hack/packages.sh

.PHONY: tools
tools: packages ## build the control plane, kwok, helm, KubeRay, Kueue, Argo CD, Karpenter (KWOK provider) and the EKS pod identity webhook from the Go module proxy (cached)
	@hack/build-tools.sh

.PHONY: cluster-tools
cluster-tools: packages ## build only what the local cluster runs (the control plane, kwok, KubeRay, the real node's)
	@hack/build-tools.sh --cluster

.PHONY: image
image: venv-operator packages ## build the operator image with podman (Dockerfile.operator on a Debian 12 base made here; cached)
	@hack/image.sh

.PHONY: dlc-image
dlc-image: venv-dlc packages ## build the DLC stand-in image the real node's Ray pods run (cached by content)
	@hack/dlc-image.sh >/dev/null

.PHONY: cluster-up
cluster-up: $(LOCAL_CLUSTER_PREREQUISITES) ## start the local cluster (control plane, fake GPU nodes, a real node, KubeRay, S3, Ray)
	@hack/cluster-up.sh

.PHONY: cluster-down
cluster-down: ## stop everything cluster-up started
	@hack/cluster-down.sh

.PHONY: lint
lint: venv-operator venv-dlc ## ruff, mypy (strict: the operator, the kubectl plugin and the client in the operator's environment, the trainer in the DLC's, with torch) and the import layers (import-linter)
	$(VENV)/bin/ruff check operator trainer kubectl_trainingrun fsdp_client tests bench
	$(VENV)/bin/ruff format --check operator trainer kubectl_trainingrun fsdp_client tests bench
	MYPY_CACHE_DIR=$(CACHE)/mypy-cache $(VENV)/bin/mypy -p fsdp_operator
	MYPY_CACHE_DIR=$(CACHE)/mypy-cache $(VENV)/bin/mypy -p kubectl_trainingrun
	MYPY_CACHE_DIR=$(CACHE)/mypy-cache $(VENV)/bin/mypy -p fsdp_client
	MYPY_CACHE_DIR=$(CACHE)/mypy-cache-dlc $(DLC_VENV)/bin/mypy -p fsdp_trainer
	PYTHONPATH=operator:trainer:kubectl_trainingrun:fsdp_client $(VENV)/bin/lint-imports

.PHONY: test
test: venv tools lint image dlc-image ## the whole suite: unit, cluster and e2e, on TEST_WORKERS local clusters side by side
	FSDP_RELIABILITY_TABLE=$(if $(PYTEST_ARGS),,docs/reliability.md) \
	  hack/test.sh $(PY) $(DLC_PY) $(TRAINER_TESTS) $(TEST_WORKERS) $(PYTEST_ARGS)

.PHONY: test-unit
test-unit: venv-operator venv-dlc ## the fast tests only (no servers, no processes)
	$(PY) -m pytest -m unit --ignore=$(TRAINER_TESTS) $(PYTEST_ARGS)
	$(DLC_PY) -m pytest -m unit $(TRAINER_TESTS) $(PYTEST_ARGS)

.PHONY: demo
demo: $(DEMO_PREREQUISITES) ## the main job end to end (local cluster, or the cluster in KUBECONFIG)
	@hack/demo.sh

# Benchmarks import the packages and tests/support as the tests do (pyproject's pytest pythonpath).
BENCH_PYTHONPATH := $(CURDIR):$(CURDIR)/operator:$(CURDIR)/trainer:$(CURDIR)/kubectl_trainingrun:$(CURDIR)/fsdp_client
bench bench-load: export PYTHONPATH := $(BENCH_PYTHONPATH)

.PHONY: bench
bench: venv tools ## benchmarks (never in CI): control plane on the local cluster, trainer on CPU (in the DLC's environment), load; GPU script in bench/
	$(PY) bench/control_plane.py
	$(DLC_PY) bench/trainer_cpu.py
	$(DLC_PY) bench/trainer_checkpoint.py
	$(DLC_PY) bench/trainer_mlflow.py
	$(DLC_PY) bench/trainer_prefetch.py
	$(DLC_PY) bench/attempt_cpu.py
	$(PY) bench/ray_idle.py
	$(PY) bench/load.py

.PHONY: bench-load
bench-load: venv tools ## 1,000 runs beside 1,000 KubeRay RayJobs, then a 10-minute soak (38-88 minutes on 2 cores: its start phase is bounded at 60)
	$(PY) bench/load.py $(LOAD_ARGS)
