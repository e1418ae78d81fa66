"""The probe's defaults, kept apart from smoke.py so that the CLI's --help (run/context.py) can
name them without importing the probe runner."""

DEFAULT_PROBE_TIMEOUT = 300.0  # seconds the in-image probe may run
DEFAULT_PROBE_SHM = "1g"  # /dev/shm of the probe containers (smoke.shm_options)
