# The two commands of the README: `make run` and `make test`. Both set up .venv on first use
# (and bring it up to date when pyproject.toml changes).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint bench-policy clean

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

test: $(STAMP)
	$(VENV)/bin/ruff check policy proxy tests benchmarks
	$(VENV)/bin/ruff format --check policy proxy tests benchmarks
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check policy proxy tests benchmarks
	$(VENV)/bin/ruff format --check policy proxy tests benchmarks

bench-policy: $(STAMP)
	$(PY) benchmarks/policy_decide.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis .ruff_cache
