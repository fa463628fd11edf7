# The two commands: `make demo` and `make test`. Each creates .venv and installs on its own.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow lint bench-quality clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# A short side-by-side simulation, data-parallel against Streaming DiLoCo: a table and a plot.
demo: $(STAMP)
	$(BIN)/streamdiloco compare --setups dp,full --workers 2 --steps 300 --eval-every 50 --out runs/demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy common
	$(BIN)/pytest -q

test-slow: $(STAMP)
	$(BIN)/pytest -q -m slow

bench-quality: $(STAMP)
	$(BIN)/python benchmarks/quality.py

clean:
	rm -rf $(VENV) runs build *.egg-info
