# Everything installs into .venv/ in the repository root.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
BASE   := $(VENV)/.stamp-base
CONVERT := $(VENV)/.stamp-convert
# pytest exits 5 when it collected nothing: that is a failure here, not a pass.
PYTEST = run() { $(BIN)/python -m pytest "$$@"; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest ran no test" >&2; return 1; fi; return $$rc; }; run

.PHONY: run test test-slow test-reference lint check-packaging install uninstall deb bench bench-llamacpp \
	bench-concurrency bench-http bench-int8 bench-first-token bench-structured bench-scaleout \
	bench-video \
	fixtures clean docs lock browser

$(BASE): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# torch first and pinned (any other request pulls CUDA builds of several GB), then the
# exporters; optimum-intel without its deps (it requires torchvision, needed only by InternVL).
$(CONVERT): $(BASE)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,convert]'
	$(BIN)/pip install -q --no-deps optimum-intel==2.2.0
	touch $@

# The main job: qvld on the bundled tiny model (or $$QVLD_MODEL), one question about
# examples/receipt.png, the streamed answer and timings, then the daemon stops.
run: $(BASE)
	tools/demo.sh

# Tests run on every CPU (pytest-xdist); --dist loadfile keeps a module's tests, and the
# daemon its module-scoped fixture starts, on one worker.
XDIST = -n auto --dist loadfile

# The default tier, the edit-test loop: everything but the slow and the reference tests.
test: $(BASE)
	$(PYTEST) $(XDIST) -m "not reference and not slow"

# The slow tier (load, fuzzing, red-team rounds, installs into sandboxes and a systemd
# guest, the web page in a browser); CI runs it after the default tier. The browser is
# Debian's chromium (Playwright's own download cannot be reached); the web page test
# leaves its screenshots in build/artifacts/.
test-slow: $(BASE) browser
	$(PYTEST) $(XDIST) -m "slow and not reference"

browser:
	command -v chromium >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; }

test-reference: $(CONVERT)
	$(PYTEST) $(XDIST) -m reference

lint: $(BASE)
	$(BIN)/ruff check qvld qvlctl tests tools bench
	$(BIN)/mypy

# requirements.lock: every runtime dependency pinned with its hashes, resolved for the
# system python3 (Debian 12's 3.11); the installer and the Debian package install
# exactly this (pip --require-hashes). Run after changing pyproject.toml's dependencies.
lock:
	rm -rf build/lock-venv && python3 -m venv build/lock-venv
	build/lock-venv/bin/pip install -q pip-tools==7.6.2
	build/lock-venv/bin/pip-compile --quiet --generate-hashes --strip-extras \
	  --no-emit-index-url --no-emit-find-links --allow-unsafe -o requirements.lock pyproject.toml

# Manual pages (qvld.8, qvlctl.1, qvld.yaml.5) and bash/zsh completion, generated from
# the parsers and the config schema (the installer and the package build them too).
docs: $(BASE)
	$(BIN)/python tools/gen_docs.py build/docs

# The alert rules must load in Prometheus (promtool comes with Debian's prometheus) and
# the HAProxy and nginx examples in Debian's HAProxy and nginx (`-c`, `-t`); lintian and
# haproxy are installed here for the package and scale-out tests of the slow tier.
check-packaging:
	command -v promtool >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; }
	command -v lintian >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends lintian; }
	command -v haproxy >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends haproxy; }
	haproxy -c -f packaging/haproxy/haproxy.cfg
	command -v nginx >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx-light; }
	mkdir -p build
	printf 'events {}\nhttp {\n include %s;\n}\n' "$(CURDIR)/packaging/nginx/qvld.conf" \
	  > build/nginx-check.conf
	nginx -t -q -c "$(CURDIR)/build/nginx-check.conf"
	promtool check rules packaging/prometheus/qvld-alerts.yml
	cd packaging/prometheus && promtool test rules qvld-alerts.test.yml
	$(PYTHON) -c "import json,sys; json.load(open('packaging/grafana/qvld-dashboard.json'))"

# As a system service: /opt/venvs/qvld, /usr/bin/qvld, units, users, /etc/qvld/qvld.yaml.
install:
	packaging/install.sh

uninstall:
	packaging/install.sh --uninstall

# qvld against its peers on the full-size random Qwen3-VL-2B (checkpoint and exports
# built once, cached outside the repository in $(BENCH_MODELS)); prints the table
# BENCHMARKS.md records. llama.cpp rows need `make bench-llamacpp` first (optional).
BENCH_MODELS ?= $(HOME)/.cache/qvld-bench
BENCH_HF := $(BENCH_MODELS)/qwen3-vl-2b-hf
# The full-size random checkpoint and its int8 export as optimum-cli writes it.
bench-int8: $(CONVERT)
	test -d $(BENCH_HF) || $(BIN)/python tools/make_test_model.py qwen3-vl-2b $(BENCH_HF) --hf-only
	test -d $(BENCH_MODELS)/qwen3-vl-2b-int8 || { $(BIN)/optimum-cli export openvino \
	  --model $(BENCH_HF) --task image-text-to-text --weight-format int8 \
	  --disable-convert-tokenizer $(BENCH_MODELS)/qwen3-vl-2b-int8 && \
	  cp $(BENCH_HF)/chat_template.jinja $(BENCH_MODELS)/qwen3-vl-2b-int8/; }

bench: bench-int8
	$(BIN)/pip install -q 'openvino-genai==2026.4.1.0' 'openvino-tokenizers==2026.4.1.0'
	test -d $(BENCH_MODELS)/qwen3-vl-2b-int8-sym || $(BIN)/qvlctl model convert $(BENCH_HF) \
	  $(BENCH_MODELS)/qwen3-vl-2b-int8-sym --weights int8
	test -d $(BENCH_MODELS)/qwen3-vl-2b-int4-sym || $(BIN)/qvlctl model convert $(BENCH_HF) \
	  $(BENCH_MODELS)/qwen3-vl-2b-int4-sym --weights int4
	test -d $(BENCH_MODELS)/qwen3-vl-2b-fp32 || $(BIN)/qvlctl model convert $(BENCH_HF) \
	  $(BENCH_MODELS)/qwen3-vl-2b-fp32 --weights fp32
	test -d $(BENCH_MODELS)/qwen3-vl-2b-onnx-fp32 || $(BIN)/qvlctl model export-onnx $(BENCH_HF) \
	  $(BENCH_MODELS)/qwen3-vl-2b-onnx-fp32 --weights fp32
	test -d $(BENCH_MODELS)/qwen3-vl-2b-onnx-int8 || $(BIN)/qvlctl model export-onnx $(BENCH_HF) \
	  $(BENCH_MODELS)/qwen3-vl-2b-onnx-int8 --weights int8
	$(BIN)/python bench/first_token.py $(BENCH_MODELS) --link-only
	$(BIN)/python bench/peers.py $(BENCH_MODELS) --rounds 3 --json $(BENCH_MODELS)/peers.json

# Concurrent clients (1, 2, 4, 8): qvld with and without continuous batching against
# llama-server --parallel N, on the int8 export and the Q8_0 GGUF (`make bench-llamacpp`
# first for the llama-server rows); the table BENCHMARKS.md records (about an hour here).
bench-concurrency: bench-int8
	$(BIN)/python bench/concurrency.py $(BENCH_MODELS) \
	  $$(test -x $(BENCH_MODELS)/llama.cpp/build/bin/llama-server || echo --systems qvld,qvld-alone) \
	  --json $(BENCH_MODELS)/concurrency.json

# What the HTTP front door adds to TTFT and decode against the socket, same daemon.
bench-http: bench-int8
	$(BIN)/python bench/http_overhead.py $(BENCH_MODELS)/qwen3-vl-2b-int8 \
	  --json $(BENCH_MODELS)/http_overhead.json

# Where a fresh image's first token goes, stage by stage: qvld (defaults: images and
# prompts on ONNX Runtime beside the int8 IR), its ONNX Runtime backend and daemon, and
# GenAI on the same IR, interleaved (BENCHMARKS.md, "First token"; about 25 minutes).
bench-first-token: bench-int8
	$(BIN)/pip install -q 'openvino-genai==2026.4.1.0' 'openvino-tokenizers==2026.4.1.0'
	test -d $(BENCH_MODELS)/qwen3-vl-2b-onnx-int8 || $(BIN)/qvlctl model export-onnx \
	  $(BENCH_HF) $(BENCH_MODELS)/qwen3-vl-2b-onnx-int8 --weights int8
	$(BIN)/python bench/first_token.py $(BENCH_MODELS) --systems qvld,qvld-ort,daemon,genai \
	  --sizes 448,large --rounds 5 --tokens 32 --json $(BENCH_MODELS)/first_token.json

# Two instances pinned to one core each against one on both cores, 4 clients.
bench-scaleout: bench-int8
	$(BIN)/python bench/scaleout.py $(BENCH_MODELS) --clients 4 --tokens 128 --rounds 2

# A question about a 10 s 1280x720 clip: qvld against GenAI's VLMPipeline (videos=) on
# the same IR, interleaved (BENCHMARKS.md, "Video"; about 15 minutes on 2 cores). The
# template is refreshed: exports made before the real Qwen3-VL template was bundled
# carry a reduced one without video placeholders.
bench-video: bench-int8
	$(BIN)/pip install -q 'openvino-genai==2026.4.1.0' 'openvino-tokenizers==2026.4.1.0'
	cp tools/qwen3_vl_chat_template.jinja $(BENCH_MODELS)/qwen3-vl-2b-int8/chat_template.jinja
	$(BIN)/python bench/video.py $(BENCH_MODELS)/qwen3-vl-2b-int8 --rounds 3 --tokens 32 \
	  --seconds 10 --size 1280x720 --json $(BENCH_MODELS)/video.json

# What a response format costs: decode with the receipt schema against unconstrained,
# compile and mask times, then 16 constrained answers validated; then an 8-field
# extraction about an image with fast-forward, without it and with GenAI's structured
# output on the same IR, interleaved (BENCHMARKS.md, "Structured output"; about 15
# minutes on 2 cores).
bench-structured: bench-int8
	$(BIN)/pip install -q 'openvino-genai==2026.4.1.0' 'openvino-tokenizers==2026.4.1.0'
	$(BIN)/python bench/structured.py $(BENCH_MODELS)/qwen3-vl-2b-int8 --rounds 5 --tokens 64 \
	  --validate 16 --json $(BENCH_MODELS)/structured.json
	$(BIN)/python bench/fast_forward.py $(BENCH_MODELS)/qwen3-vl-2b-int8 --rounds 3 \
	  --max-tokens 200 --json $(BENCH_MODELS)/fast_forward.json

# llama.cpp from the copy vendored in llama-cpp-python's sdist, and GGUF conversions
# (bf16, Q8_0, Q4_K_M, mmproj f16) of the same checkpoint, for `make bench`.
bench-llamacpp: $(CONVERT)
	$(BIN)/pip install -q sentencepiece
	QVLD_BENCH_CACHE=$(BENCH_MODELS) bench/build_llamacpp.sh $(BIN)/python
	test -d $(BENCH_HF) || $(BIN)/python tools/make_test_model.py qwen3-vl-2b $(BENCH_HF) --hf-only
	$(BIN)/python bench/convert_gguf.py $(BENCH_HF) $(BENCH_MODELS)/gguf \
	  --llamacpp $(BENCH_MODELS)/llama.cpp

# A Debian package from the same files (dist/qvld_VERSION_ARCH.deb).
deb:
	packaging/deb/build.sh dist

# Rebuild the committed tiny model and its transformers reference (deterministic).
fixtures: $(CONVERT)
	rm -rf tests/fixtures/models/tiny
	$(BIN)/python tools/make_test_model.py tiny tests/fixtures/models/tiny --reference --onnx

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
