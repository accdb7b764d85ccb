"""Hypothesis profiles for the property suite, and the end-of-session mutation kill-rate report.

AMK_HYPOTHESIS_PROFILE picks the profile (default `ci`):
  ci       derandomized, no example database, the whole suite in well under 3 minutes on 2 cores
  dev      random (a fresh seed each run, printed with any failure), a local example database
  nightly  random, many examples
Every profile prints the @reproduce_failure blob of a failure (print_blob).
"""
from __future__ import annotations

import os
import random

from hypothesis import HealthCheck, settings

import prop_support

_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", derandomize=True, database=None, max_examples=25, **_COMMON)
settings.register_profile("dev", max_examples=60, **_COMMON)
settings.register_profile("nightly", max_examples=1000, **_COMMON)

PROFILE = os.environ.get("AMK_HYPOTHESIS_PROFILE", "ci")
if PROFILE not in ("ci", "dev", "nightly"):
    raise RuntimeError(f"AMK_HYPOTHESIS_PROFILE={PROFILE!r}: choose ci, dev or nightly")
settings.load_profile(PROFILE)
prop_support.PROFILE = PROFILE


def pytest_configure(config):
    # A random profile without --hypothesis-seed gets a seed we choose, so a failure can print a
    # one-line command that replays it (Hypothesis's own --hypothesis-seed does the same).
    seed = config.getoption("hypothesis_seed", None)
    if seed is None and not settings.default.derandomize:
        seed = random.randrange(2 ** 32)
        import hypothesis.core
        hypothesis.core.global_force_seed = seed
    prop_support.SEED = seed


def pytest_terminal_summary(terminalreporter):
    text = prop_support.kill_report()
    if text:
        terminalreporter.write_sep("-", "AMK mutation kill rate (validate vs. mutated schedules)")
        terminalreporter.write_line(text)
