# The two commands of the README: `make run` and `make test`. Both create .venv on first use.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint bench-policy clean

$(STAMP): pyproject.toml scripts/find-python
	@py=$$(scripts/find-python) || exit 1; \
	  echo "creating $(VENV) with $$py"; \
	  rm -rf $(VENV) && "$$py" -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/egress-proxy check examples/agent.yaml --ceiling examples/ceiling.yaml --config examples/config.yaml
	$(VENV)/bin/egress-proxy explain examples/agent.yaml --ceiling examples/ceiling.yaml --config examples/config.yaml \
	  api.github.com https://pypi.org/simple/ example.org 127.1

test: $(STAMP)
	$(VENV)/bin/ruff check policy proxy tests benchmarks
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check policy proxy tests benchmarks
	$(VENV)/bin/ruff format --check policy proxy tests benchmarks

bench-policy: $(STAMP)
	$(PY) benchmarks/policy_decide.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
