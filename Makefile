# The two commands: `make demo` and `make test`. Each creates .venv and installs on its own.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo compare test test-slow typecheck system-deps lint bench-quality bench-quality-long bench-wire bench-elastic bench-monitoring bench-sync-cost bench-memory bench-real bench-wan protos clean

# The exact, tested versions of constraints.txt (pyproject.toml has only ranges), installed by uv: pip took
# 2.4 minutes of a clean `make test`, uv 45 s. Byte-compiled as pip does: where PYTHONDONTWRITEBYTECODE is
# set, every process would compile numba's and transformers' sources again (the codec's first call, 2.5 s). The --find-links folders
# that pip is configured with (a local CPU wheel of torch, say) are passed on to uv; should uv fail, pip runs
# (--build-constraint: pip >= 25.3).
FIND_LINKS = $(sort $(PIP_FIND_LINKS) $(shell $(PY) -m pip config list 2>/dev/null | sed -n "s/.*find-links='\(.*\)'/\1/p"))
$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt uv
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python $(foreach d,$(FIND_LINKS),--find-links $(d)) \
		-c constraints.txt --build-constraints constraints.txt -e '.[dev]' \
	|| { $(BIN)/pip install -q --upgrade pip && \
	     $(BIN)/pip install -q -c constraints.txt --build-constraint constraints.txt -e '.[dev]'; }
	touch $(STAMP)

venv: $(STAMP)

# A real run on this machine: 2 shard processes and 2 worker processes on loopback, a few minutes of
# training with progress output, then a summary. Ctrl+C stops every process.
demo: $(STAMP)
	$(BIN)/streamdiloco launch --shards 2 --workers 2 --steps 800 --log-every 100 --out runs/demo

# Data-parallel against Streaming DiLoCo, simulated side by side: a table and a plot.
compare: $(STAMP)
	$(BIN)/streamdiloco compare --setups dp,full --workers 2 --steps 300 --eval-every 50 --out runs/compare

system-deps:
	bash scripts/system-deps.sh

# pytest on two processes (a file stays on one; the slowest 25 listed); mypy beside it at a lower priority, on
# the CPU that tests leave idle while they wait on their processes (it took a minute on its own)
test: $(STAMP) system-deps
	$(BIN)/ruff check .
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict
	@mkdir -p build; nice -n 10 $(BIN)/python scripts/typecheck.py > build/typecheck.log 2>&1 & mypy=$$!; \
	$(BIN)/pytest -q -n 2 --dist loadfile --durations=25; tests=$$?; \
	wait $$mypy; types=$$?; echo "scripts/typecheck.py (mypy, beside pytest): exit $$types"; \
	cat build/typecheck.log; exit $$((tests || types))

# mypy over the package as it imports (streamdiloco.*), through a symlink tree: scripts/typecheck.py
typecheck: $(STAMP)
	$(BIN)/python scripts/typecheck.py

test-slow: $(STAMP)
	$(BIN)/pytest -q -m slow

bench-quality: $(STAMP)
	$(BIN)/python -m benchmarks.quality

# DP against the full method at M = 2, 4, 8 at 20 tokens per parameter (nano); not in make test
bench-quality-long: $(STAMP)
	$(BIN)/python -m benchmarks.quality_long

bench-wire: $(STAMP)
	$(BIN)/python -m benchmarks.wire

bench-elastic: $(STAMP)
	$(BIN)/python -m benchmarks.elastic

bench-monitoring: $(STAMP)
	$(BIN)/python -m benchmarks.monitoring

# Issue 11: a GPU worker's compute utilization against real shards (emulated GPU steps), 1M-300M parameters.
bench-sync-cost: $(STAMP)
	$(BIN)/python -m benchmarks.sync_cost

# Issue 25: what a worker holds in memory beside its model (RSS at connect and 2H steps; the engine's tensors)
bench-memory: $(STAMP)
	$(BIN)/python -m benchmarks.worker_memory

# Streaming DiLoCo against DDP over emulated WAN links (network namespaces, tbf, a delaying proxy): a sweep of
# The 10M GPT-2 (examples/gpt2-10m) on Debian's fortunes and the plays, prepared with a trained BPE: 1 shard and
# 2 worker processes through the CLI against DDP on the same pieces; exported, loaded with from_pretrained,
# sampled. About 40 minutes on 2 cores; writes benchmarks/results/real/.
bench-real: $(STAMP)
	bash scripts/system-deps.sh real
	$(BIN)/python -m benchmarks.real $(REAL_FLAGS)

# bandwidth x delay, hours long; needs root. Writes benchmarks/results/wan/. A small grid (minutes):
# make bench-wan WAN_FLAGS=--quick
bench-wan: $(STAMP)
	bash scripts/system-deps.sh wan
	$(BIN)/python -m benchmarks.wan $(WAN_FLAGS)

# Regenerate protos/*_pb2*.py after editing protos/streamdiloco.proto (a test fails when they are stale).
protos: $(STAMP)
	$(BIN)/python protos/generate.py

clean:
	rm -rf $(VENV) runs build *.egg-info
