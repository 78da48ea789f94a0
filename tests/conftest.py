"""Settings every tier shares (unit, integration, e2e)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

# A property test proves a property, never a speed. On a fresh clone Hypothesis starts cold (an
# empty .hypothesis database, Unicode tables and source constants not cached yet) and a busy
# 2-core machine is slow besides: its default 200 ms deadline per example and its "input
# generation is slow" health check would then fail tests whose property holds. The other health
# checks (a strategy that filters out most of what it draws, data too large) are about the
# strategy, not the machine, and stay on. A test's own @settings still overrides any of this.
settings.register_profile("extproc", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("extproc")
