"""The cron-loop fixtures (``home``, ``build``) for every test of the scheduler."""

from tests.unit.schedules.test_cron_loop import build, home  # noqa: F401
