# rlm-ops: `make demo` runs the main job on the embedded default, `make test` runs everything CI runs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Debian packages the tests use for real: sshd for the rig, Prometheus/Alertmanager/node_exporter
# for monitoring, nftables for the firewall role, iproute2 for namespaces; mmdebstrap,
# systemd-container (systemd-nspawn) and apt-utils (apt-ftparchive) for the rig's systemd nodes;
# rocm-smi (the real AMD tool, runs without a GPU) for the exporter's recorded fixture; gpg signs
# the stand-in vendor repositories (tests/ansible/vendor_repo.py); podman builds and runs the
# trainer's OCI image offline (tests/rig/container.py), with runc where cgroups are hybrid.
TEST_SYSTEM_PACKAGES := openssh-server openssh-client prometheus prometheus-alertmanager \
	prometheus-node-exporter nftables iproute2 procps psmisc util-linux \
	mmdebstrap systemd-container apt-utils rocm-smi python3-firewall gpg podman runc
DEMO_SYSTEM_PACKAGES := procps

.PHONY: demo check unit-tests test test-cpu test-wheelhouses lint bench venv clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[controller,train,dev]'
	touch $@

venv: $(VENV)/.installed

# Installs missing Debian packages when running as root; otherwise says what to install.
define ensure_packages
	@missing=""; for p in $(1); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'ok installed' || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing system packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else \
	    echo "missing system packages:$$missing (install them as root: apt-get install$$missing)"; \
	  fi; \
	fi
endef

demo: venv
	$(call ensure_packages,$(DEMO_SYSTEM_PACKAGES))
	$(BIN)/python -m rlmctl demo

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/yamllint -s .
	$(BIN)/ansible-lint --offline --profile production playbooks roles
	$(BIN)/mypy

# The fast lane for daily work: lint, types and the unit tests: none that needs the rig or
# ansible-playbook (tests/conftest.py marks those; RLM_TEST_LANE=check refuses a playbook run
# that escaped the marker), none marked `integration` (whole multi-process runs, tens of seconds
# each). No system packages needed beyond what the venv brings. Lint and the tests run side by
# side, each one's output printed whole when it ends: lint alone is a minute of mostly one core
# (ansible-lint), which the tests' two workers leave partly idle.
check: venv
	$(MAKE) --no-print-directory -j2 --output-sync=target lint unit-tests

unit-tests: venv
	RLM_TEST_LANE=check $(BIN)/pytest -n 2 -m "not rig and not playbook and not integration" $(PYTEST_ARGS)

# Two workers, a test file at a time each: the rig modules wait on daemons much of the time
# (tests/conftest.py). The 25 slowest phases are printed at the end, where CI logs keep them.
# Lint (~50 s of one core from a clean clone) runs beside the tests, which leave a core idle
# while they start; its output follows theirs, and either failing fails the target.
# `pytest FILE` alone runs in one process as usual.
test: venv
	$(call ensure_packages,$(TEST_SYSTEM_PACKAGES))
	@mkdir -p .cache; $(MAKE) --no-print-directory lint > .cache/lint.log 2>&1 & lint=$$!; \
	$(BIN)/pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS); \
	tests=$$?; wait $$lint; linted=$$?; \
	echo "--- make lint (exit $$linted) ---"; cat .cache/lint.log; \
	[ $$tests = 0 ] && [ $$linted = 0 ]

# make test under the kernel's process accounting (root), then where its CPU went: the trainer's
# ranks, ansible-playbook, the rig nodes, the tests' own processes; and per test file
# (tests/suite_cpu.py).
test-cpu: venv
	$(BIN)/python -m tests.suite_cpu --keep .cache/make-test.pacct --timeline .cache/make-test.timeline \
		-- $(MAKE) --no-print-directory test

# The air-gapped site's full wheelhouses (cp311 and cp313, 3 GB) installed offline on a Debian 12
# and a Debian 13 node, and a training on the latter: ~20-25 min more than test_site_systemd.py's
# ~19 min on a fresh 2-core machine, so `make test` (CI) leaves them out.
test-wheelhouses: venv
	$(call ensure_packages,$(TEST_SYSTEM_PACKAGES))
	RLM_TEST_FULL_WHEELHOUSES=1 $(BIN)/pytest tests/ansible/test_site_systemd.py $(PYTEST_ARGS)

bench: venv
	@for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
