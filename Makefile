# sgl-tts: `make run` sets up and runs the CPU default; `make test` sets up and runs the tests.
PY := .venv/bin/python
CONFIG ?= eval/configs/cpu-default.yaml
RUN_CONFIG ?= configs/cpu-default.yaml

.PHONY: setup run test test-fast bench eval clean

setup:
	@bash scripts/setup.sh

run: setup
	.venv/bin/sgl-tts run --config $(RUN_CONFIG)

test: setup
	$(PY) -m pytest -q -ra

test-fast: setup
	$(PY) -m pytest -q -m "not runtime"

bench: setup
	.venv/bin/sgl-tts bench runtime
	.venv/bin/sgl-tts bench fasttts

eval: setup
	.venv/bin/sgl-tts eval --config $(CONFIG)

clean:
	rm -rf .pytest_cache build *.egg-info
