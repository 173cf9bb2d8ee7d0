"""File-backed schedules: workflow and product jobs, one job model, the cron loop, sessions.

Definitions live in the workflow root's files (workflows/, products/); this
package decides when they run and runs them through the agent runtime.
"""
