# sgl-tts: `make run` sets up and runs the CPU default; `make test` sets up and runs the tests.
PY := .venv/bin/python
CONFIG ?= eval/configs/cpu-default.yaml
RUN_CONFIG ?= sgl_tts/configs/cpu-default.yaml  # a path, or a packaged config's name

.PHONY: setup peers run test test-fast bench eval clean

setup:
	@bash scripts/setup.sh

peers:  # the its-hub and optillm pins of the `peers` extra, into this checkout's .venv (sgl-tts bench peers)
	@bash scripts/setup.sh --peers

run: setup
	.venv/bin/sgl-tts run --config $(RUN_CONFIG) --compare

test: setup
	$(PY) -m pytest -q -ra --durations=25

test-fast: setup
	$(PY) -m pytest -q -m "not runtime"

bench: setup
	.venv/bin/sgl-tts bench runtime
	.venv/bin/sgl-tts bench fasttts --quick

eval: setup
	.venv/bin/sgl-tts eval --config $(CONFIG)

clean:
	rm -rf .pytest_cache build *.egg-info
