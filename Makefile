# ragcache: `make demo` runs the main job on embedded defaults, `make test` runs the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ragcache-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test test-unit ui bench clean-cache

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	VENV=$(VENV) bash scripts/install.sh
	touch $(STAMP)

demo: setup
	$(VENV)/bin/ragcache demo

test: setup
	$(PY) -m pytest tests

test-unit: setup
	$(PY) -m pytest tests -m "not integration"

ui: setup
	$(VENV)/bin/streamlit run ui/app.py

bench: setup
	$(VENV)/bin/ragcache bench ttft --n 10 --out results/bench_ttft.json

clean-cache:
	rm -rf indexes/* ~/.cache/ragcache/kv
