# ragcache: `make demo` runs the main job on embedded defaults, `make test` runs the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ragcache-installed
# (the offline defaults HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE are set by `import ragcache` itself)

.PHONY: setup demo test test-unit ui bench clean-cache

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	VENV=$(VENV) bash scripts/install.sh
	touch $(STAMP)

demo: setup
	$(VENV)/bin/ragcache demo

# the whole suite: also what its tests need beyond setup (redis-server, haproxy, chromium, the scale
# extra), installed by scripts/test_deps.sh where it can (root, apt-get) or named with the command
test: setup
	VENV=$(VENV) bash scripts/test_deps.sh
	$(PY) -m pytest tests

test-unit: setup
	$(PY) -m pytest tests -m "not integration and not slow"

ui: setup
	$(VENV)/bin/streamlit run ui/app.py

# every benchmark once (hours on a 2-core CPU); results/ is not committed: the tables, plots and
# JSON are copied to docs/bench/, and docs/benchmarks.md's tables are regenerated from that JSON
BENCH_N ?= 10
bench: setup
	$(VENV)/bin/ragcache bench ttft --dataset musique --n $(BENCH_N) --out results/bench_ttft.json
	$(VENV)/bin/ragcache bench ttft --dataset hotpotqa --n $(BENCH_N) --out results/bench_ttft_hotpotqa.json
	$(VENV)/bin/ragcache bench hotset --out results/bench_hotset.json
	$(VENV)/bin/ragcache bench throughput --out results/bench_throughput.json
	$(VENV)/bin/ragcache bench tiers --out results/bench_tier_ttft.json
	$(VENV)/bin/ragcache bench ingest --out results/bench_ingest.json
	$(VENV)/bin/ragcache bench serve --out results/bench_serve.json
	$(VENV)/bin/ragcache bench bandwidth --out results/bench_bandwidth.json
	$(VENV)/bin/ragcache bench retrieval --out results/bench_retrieval.json
	$(VENV)/bin/ragcache bench coldstart --out results/bench_coldstart.json
	mkdir -p docs/bench
	for b in ttft ttft_hotpotqa hotset throughput tier_ttft ingest serve bandwidth retrieval coldstart; do \
	  for f in results/bench_$$b.json results/bench_$$b.md results/bench_$$b.png; do [ ! -f $$f ] || cp -f $$f docs/bench/; done; \
	done
	$(VENV)/bin/ragcache bench report docs/benchmarks.md

clean-cache:
	rm -rf indexes/* ~/.cache/ragcache/kv
