"""egress-proxy: the session proxy's runtime (the decision core is the `policy` package)."""

# The one place the version is written: pyproject.toml reads it from here, and the running proxy
# reports it without asking the installed metadata (a scan of every installed package's files,
# at every start-up).
__version__ = "0.1.0"
