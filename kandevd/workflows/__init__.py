"""The files of a workflow folder: manifest, variables, run history, decisions."""
