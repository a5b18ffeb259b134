# Two entry points for a fresh machine (see README): `make demo` and `make test`.
# Both create .venv on first use and install the project with the CPU pins.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU pins: the CPU build of torch that pip finds on these machines, and the Triton whose
# interpreter runs the kernels without a GPU.
CPU_PINS := torch==2.13.0 "triton>=3.9,<3.10" "numpy>=1.26"

.PHONY: demo test lint install clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(CPU_PINS)
	$(BIN)/python -m pip install -q -e ".[llm,test]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/coda-agent synthesize --block llama_mlp

test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -n 2

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
