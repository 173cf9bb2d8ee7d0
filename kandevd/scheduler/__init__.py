"""The file-backed workflow scheduler: job registry, cron loop, sessions, switches.

Definitions live in the workflow root's files (``kandevd.workflows``); this
package decides when they run and runs them through the agent runtime.
"""
