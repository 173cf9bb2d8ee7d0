"""Office's tables and every statement Office makes: what an Office task is
(predicate.py, once, in SQL and Python), budgets (budgets.py), routines
(routines.py), the runs of Office tasks (tasks.py), and the rows the ``office.*``
methods create and list (admin.py). The rules (thresholds, periods, catch-up,
chains, keys) stay in :mod:`kandevd.office`; what a statement needs of them
comes in as a parameter."""
