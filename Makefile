# The two commands of the README: `make run` and `make test`. Both set up .venv on first use
# (and bring it up to date when pyproject.toml changes).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint docs bench-policy bench bench-quick bench-deps clean

CREATED := $(VENV)/.created

# A stamp file, not bin/python: that is a symlink, and make would read the interpreter's age.
$(CREATED):
	@py=$$(scripts/find-python) || exit 1; \
	  echo "creating $(VENV) with $$py"; \
	  rm -rf $(VENV) && "$$py" -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@touch $(CREATED)

$(STAMP): $(CREATED) pyproject.toml
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/egress-proxy check examples/agent.yaml --ceiling examples/ceiling.yaml \
	  --config examples/run-config.yaml
	exec $(VENV)/bin/egress-proxy run examples/agent.yaml --ceiling examples/ceiling.yaml \
	  --config examples/run-config.yaml

test: lint
	$(PY) -m pytest

# mypy at the lowest Python the project supports (pyproject.toml: [tool.mypy]).
lint: $(STAMP)
	$(VENV)/bin/ruff check policy proxy tests benchmarks
	$(VENV)/bin/ruff format --check policy proxy tests benchmarks
	$(VENV)/bin/mypy
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir build/site

# The documentation site (docs/, mkdocs.yml), served at http://127.0.0.1:8000 as it is edited.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

# The decision core (benchmarks/README.md); `make bench-policy ARGS='--quick --sizes 10,100'`
# is a check in about a second that it still runs.
bench-policy: $(STAMP)
	$(PY) benchmarks/policy_decide.py $(ARGS)

# The benchmark harness (benchmarks/README.md): `make bench-deps` once, then `make bench` (full:
# every configuration, 3 rounds) or `make bench-quick` (2 rounds of direct, egress-proxy, squid
# and tinyproxy: under 2 minutes). ARGS passes options on, e.g.
# `make bench-quick ARGS='--configs direct,egress-proxy,squid --workloads tunnels,http'`. A peer
# that is not installed is skipped with a note; the load generator
# (benchmarks/harness/loadgen.c) is compiled with gcc into benchmarks/build/ (OpenSSL's headers
# add its HTTPS mode). The packages' own services are not used (nor needed).
BENCH_PACKAGES := squid tinyproxy privoxy wrk nginx-light gcc libssl-dev

bench-deps: $(STAMP)
	@if [ "$$(id -u)" = 0 ]; then apt-get install -y $(BENCH_PACKAGES); \
	  else sudo apt-get install -y $(BENCH_PACKAGES); fi
	$(PY) -m pip install --quiet -e '.[test,bench]'

bench: $(STAMP)
	$(PY) benchmarks/bench.py $(ARGS)

bench-quick: $(STAMP)
	$(PY) benchmarks/bench.py --quick $(ARGS)

clean:
	rm -rf $(VENV) build benchmarks/build *.egg-info .pytest_cache .hypothesis .ruff_cache
