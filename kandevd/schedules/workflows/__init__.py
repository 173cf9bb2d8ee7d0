"""Workflow schedules: the files of a workflow folder, its jobs and its program of turns."""
